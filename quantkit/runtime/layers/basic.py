"""RMSNorm, rotary embedding and the MLP's SiLU-and-multiply, computed as HF transformers computes them (so
outputs can match token for token). With `fused` each is one call into kernels.fused instead of a PyTorch chain."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quantkit.kernels import fused as fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, weight: Tensor, eps: float, dtype: torch.dtype, fused: bool = False):
        super().__init__()
        self.weight, self.eps, self.fused = weight.to(dtype).contiguous(), eps, fused

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden]
        if self.fused:
            return fused_kernels.ops().rms_norm(x.contiguous(), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add before a norm: (x + r, norm(x + r))."""
        if self.fused:
            return tuple(fused_kernels.ops().add_rms_norm(x.contiguous(), r.contiguous(), self.weight, self.eps))
        x = x + r
        return x, self(x)


class Rotary:
    """cos/sin per position from HF's own rotary class, so every rope variant (Llama 3 scaling, YaRN, ...)
    comes out exactly as HF computes it."""

    def __init__(self, hf_config, dtype: torch.dtype, device: str):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rope = LlamaRotaryEmbedding(config=hf_config).to(device)
        self.dtype = dtype

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [T] -> cos, sin [T, head_dim]
        probe = torch.empty(0, dtype=self.dtype, device=positions.device)
        cos, sin = self.rope(probe, positions.unsqueeze(0))
        return cos[0].contiguous(), sin[0].contiguous()


def rotate_heads(x: Tensor, heads: int, cos: Tensor, sin: Tensor, fused: bool) -> Tensor:
    """The first `heads` heads of x [T, H, d] rotated (queries and keys in one pass) -> [T, heads, d]; in place when fused."""
    if fused and x.stride(1) == x.shape[2] and x.stride(2) == 1:
        fused_kernels.ops().rope_(x, cos, sin, heads)
        return x[:, :heads]
    return apply_rotary(x[:, :heads], cos, sin)


def silu_mul(gate_up: Tensor, fused: bool) -> Tensor:
    """SiLU(gate) * up for gate_up [T, 2 * inter] -> [T, inter]."""
    if fused:
        return fused_kernels.ops().silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, d]; cos/sin [T, d] (the two halves repeated, HF's layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
