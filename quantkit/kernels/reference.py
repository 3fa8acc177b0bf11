"""Pure-torch reference ops: simple enough to be obviously right, and the oracle the fast paths are tested against."""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequant_linear(x: Tensor, q: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
    """x [t, in] @ dequantized weight.T -> [t, out]; q int8 [out, in], scale/zero_point [out, groups]."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    w = q.float().view(out_features, groups, -1)
    if zero_point is not None:
        w = w - zero_point.float().unsqueeze(-1)
    w = (w * scale.float().unsqueeze(-1)).view(out_features, in_features)
    return x @ w.to(x.dtype).T


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale saturated to float8_e4m3fn (scale broadcasts: [1] or [kv_heads, 1, 1] against [..., kv_heads, head_dim])."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (x.float() * scale).to(dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, start: int, window: int = 0) -> Tensor:
    """Causal attention of one sequence's new queries over all its keys (the last `window` of them, when set).

    q [n, heads, d] for positions start..start+n-1; k, v [start+n, kv_heads, d] -> [n, heads, d].
    Grouped-query: each KV head serves heads/kv_heads query heads.
    """
    n, heads, d = q.shape
    total, kv_heads, _ = k.shape
    rep = heads // kv_heads
    k = k.repeat_interleave(rep, dim=1)  # [total, heads, d]
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.float(), k.float()) / d**0.5  # [heads, n, total]
    pos_q = torch.arange(start, start + n, device=q.device).unsqueeze(1)
    pos_k = torch.arange(total, device=q.device).unsqueeze(0)
    hidden = pos_k > pos_q
    if window:
        hidden |= pos_k <= pos_q - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v.float()).to(q.dtype)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, window: int = 0) -> Tensor:
    """One new query per sequence: q [S, heads, d] over k, v [S, L, kv_heads, d], of which the first
    lengths[i] are sequence i's -> [S, heads, d]."""
    return torch.stack([attention(q[i : i + 1], k[i, : int(n)], v[i, : int(n)], int(n) - 1, window)[0]
                        for i, n in enumerate(lengths)])
