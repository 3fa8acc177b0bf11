"""RMSNorm and rotary embedding, computed as HF transformers computes them (so outputs can match token for token)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, weight: Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight, self.eps = weight.to(dtype), eps

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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
        return cos[0], sin[0]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, d]; cos/sin [T, d] (the two halves repeated, HF's layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
