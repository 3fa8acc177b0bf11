"""FP8 (E4M3) KV-cache scales: scale = absmax of the post-RoPE keys (or the values) / 448.

A consumer stores k / k_scale in FP8, whose largest finite value is 448, so the calibration absmax maps
exactly onto the top of the FP8 range. Per tensor (one scale) or per KV head ([num_kv_heads, 1, 1]).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_E4M3_MAX = 448.0


def absmax(x: Tensor, strategy: str) -> Tensor:
    """x [batch, kv_heads, seq, head_dim] -> running-max contribution: [1] (tensor) or [kv_heads] (head)."""
    if strategy == "tensor":
        return x.detach().abs().amax().float().reshape(1)
    return x.detach().abs().amax(dim=(0, 2, 3)).float()


def kv_scale(amax: Tensor, strategy: str, dtype: torch.dtype) -> Tensor:
    """absmax / 448 in `dtype`, rounded up where the dtype rounded it down, so absmax / scale <= 448."""
    scale = (amax.float() / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float16).tiny)
    stored = scale.to(dtype)
    if dtype in (torch.bfloat16, torch.float16):
        up = (stored.view(torch.int16) + 1).view(dtype)  # next representable value (positive floats)
        stored = torch.where(stored.float() < scale, up, stored)
    return stored.reshape(1) if strategy == "tensor" else stored.reshape(-1, 1, 1)
