"""RMSNorm, rotary embedding and the MLP's SiLU-and-multiply, computed as HF transformers computes them (so
outputs can match token for token). With `fused` each is one call into kernels.fused instead of a PyTorch chain."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from quantkit import QuantkitError
from quantkit.kernels import fused as fused_kernels


class RMSNorm(nn.Module):
    """Llama's norm, w * norm(x) rounded to x's dtype first; with `offset` (Gemma: 1), (offset + w) * norm(x) in
    float32, then rounded, as Gemma computes it. The fused op does either, by its weight's dtype (float32:
    Gemma's): one call where the PyTorch ops are eight, and Gemma 3 runs 6 norms a layer."""

    def __init__(self, weight: Tensor, eps: float, dtype: torch.dtype, fused: bool = False, offset: float = 0.0):
        super().__init__()
        self.eps, self.fused, self.offset = eps, fused, offset
        self.weight = (offset + weight.float()).contiguous() if offset else weight.to(dtype).contiguous()

    def forward(self, x: Tensor) -> Tensor:  # [..., hidden]
        if self.fused:
            return fused_kernels.ops().rms_norm(x.contiguous(), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype) if self.offset else self.weight * h.to(x.dtype)

    def add(self, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add before a norm: (x + r, norm(x + r))."""
        if self.fused:
            return tuple(fused_kernels.ops().add_rms_norm(x.contiguous(), r.contiguous(), self.weight, self.eps))
        x = x + r
        return x, self(x)


class Rotary:
    """cos/sin per position, as HF computes them (so every rope variant comes out exactly as HF's). The plain
    rope (theta only: SmolLM2, Qwen2.5) is computed here from config.json with HF's own formula; scaled variants
    (Llama 3, YaRN, dynamic, ...) use HF's rotary class, whose import costs a second or two of start-up."""

    def __init__(self, path: Path, hf: dict, dtype: torch.dtype, device: str, kind: str = "full_attention"):
        self.dtype, self.scaling, self.rope = dtype, 1.0, None
        params = rope_parameters(hf, kind)
        factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))  # rotate the first part of a head
        self.dim = dim = int((hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) * factor)
        if params.get("rope_type", "default") in ("default", "linear"):
            self.inv_freq = 1.0 / (params.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            if params.get("rope_type") == "linear":  # positions divided by the factor, as HF's linear scaling
                self.inv_freq = self.inv_freq / params["factor"]
            self.inv_freq = self.inv_freq.to(device)  # [dim / 2]
        elif set(rope_parameters_by_kind(hf)) - {"_"}:
            raise QuantkitError(f"{path}: rope type {params.get('rope_type')!r} on a model with per-layer ropes is not supported")
        else:
            from transformers import AutoConfig
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            self.rope = LlamaRotaryEmbedding(config=AutoConfig.from_pretrained(path)).to(device)

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [T] -> cos, sin [T, head_dim]
        if self.rope is not None:
            probe = torch.empty(0, dtype=self.dtype, device=positions.device)
            cos, sin = self.rope(probe, positions.unsqueeze(0))
            return cos[0].contiguous(), sin[0].contiguous()
        freqs = positions[:, None].float() * self.inv_freq  # [T, dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def rope_parameters(hf: dict, kind: str = "full_attention") -> dict:
    """rope_type / rope_theta / scaling for one kind of layer, from a config.json of either layout: transformers
    5's `rope_parameters` (one dict, or one per layer kind: Gemma 3's sliding and full layers), or the older
    top-level `rope_theta` with `rope_scaling` (and Gemma 3's `rope_local_base_freq` for sliding layers)."""
    by_kind = rope_parameters_by_kind(hf)
    if by_kind:
        return dict(by_kind.get(kind) or by_kind.get("_") or {})
    if kind == "sliding_attention" and hf.get("rope_local_base_freq"):
        return {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": hf.get("rope_theta", 10000.0)}


def rope_parameters_by_kind(hf: dict) -> dict[str, dict]:
    """transformers 5's `rope_parameters` keyed by layer kind; a single dict under "_"; {} when absent."""
    params = hf.get("rope_parameters")
    if not params:
        return {}
    return dict(params) if all(isinstance(v, dict) for v in params.values()) else {"_": dict(params)}


def rotate_heads(x: Tensor, heads: int, cos: Tensor, sin: Tensor, fused: bool) -> Tensor:
    """The first `heads` heads of x [T, H, d] rotated (queries and keys in one pass) -> [T, heads, d]; in place when fused.
    With partial rotary (cos/sin narrower than d: Phi-4-mini) only each head's first part turns."""
    rot = cos.shape[-1]
    if rot < x.shape[2]:
        y = x[:, :heads]
        return torch.cat([apply_rotary(y[..., :rot], cos, sin), y[..., rot:]], dim=-1)
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


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    """GeGLU: GELU(gate, tanh approximation) * up for gate_up [T, 2 * inter] -> [T, inter] (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, d]; cos/sin [T, d] (the two halves repeated, HF's layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
