"""PyTorch's packed integer matmuls on CPU: `_weight_int4pack_mm_for_cpu` (groups of 32-256, bf16 or fp32
activations) and `_weight_int8pack_mm` (one scale per output channel).

Weights are repacked once at load from the checkpoint's generic layout (signed q, scale, optional zero
point) into what these ops read. `int4_supported` / `int8_supported` say when a shape fits; otherwise
the runtime keeps the reference path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantkit.formats.pack import unpack_int32

INT4_GROUPS = (256, 128, 64, 32)


def int4_group(in_features: int, group_size: int | None) -> int | None:
    """The group size the int4 op will use: the scheme's own, or for per-channel scales the largest
    supported size dividing the row (the channel scale repeated per group)."""
    if group_size is not None:
        return group_size if group_size in INT4_GROUPS else None
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def int4_supported(out_features: int, in_features: int, group_size: int | None) -> bool:
    return out_features % 16 == 0 and int4_group(in_features, group_size) is not None


def repack_int4(q: Tensor, scale: Tensor, zero_point: Tensor | None, group_size: int | None, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """q int8 [out, in] in [-8, 7], scale/zero_point [out, groups] -> (packed uint8, scales_and_zeros [g', out, 2], g').

    The op computes w = (u - 8) * scale + zero with u = q + 8, so zero = -zero_point * scale."""
    out_features, in_features = q.shape
    group = int4_group(in_features, group_size)
    reps = (in_features // group) // scale.shape[1]  # > 1 only for per-channel scales
    scale = scale.float().repeat_interleave(reps, dim=1)
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.float().repeat_interleave(reps, dim=1) * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 2)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [groups, out, 2]
    return packed, scales_zeros, group


def int4_linear(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    """x [t, in] -> [t, out]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group, scales_zeros)


def dequant_int4(words: Tensor, scale: Tensor, zero_point: Tensor | None, in_features: int, dtype: torch.dtype) -> Tensor:
    """The dense weight [out, in] in `dtype` from the checkpoint's int32 packing: for matmuls with many rows,
    where a dense GEMM beats the int4 kernel. (q - zp) is exact in any float dtype and the product with the
    scale is rounded once, so this equals the float32 reference rounded to `dtype`."""
    q = unpack_int32(words, 4, in_features).to(dtype)  # [out, in]
    out_features, groups = scale.shape
    g = q.view(out_features, groups, -1)
    if zero_point is not None:
        g = g - zero_point.to(dtype).unsqueeze(-1)
    return (g * scale.to(dtype).unsqueeze(-1)).view(out_features, in_features)


def int8_supported(group_size: int | None, symmetric: bool) -> bool:
    return group_size is None and symmetric


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x [t, in], q int8 [out, in], scale [out] in x's dtype -> [t, out]."""
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale)


def dequant_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q int8 [out, in], scale [out] in the activations' dtype -> the dense weight [out, in] in that dtype, for
    prefill-sized matmuls: `_weight_int8pack_mm`'s cost grows linearly with rows (1.46 s for a 2048-row 1.5B
    gate/up here, against 0.38 s dequantised). q is exact in bf16, so each weight is rounded once."""
    return q.to(scale.dtype) * scale.unsqueeze(1)


def attention(q: Tensor, k: Tensor, v: Tensor, start: int, window: int = 0) -> Tensor:
    """Causal attention of one sequence's new queries over all its keys, with PyTorch's fused SDPA.

    q [n, heads, d] at positions start..start+n-1; k, v [start+n, kv_heads, d] -> [n, heads, d]. With `window`,
    a query sees only the last `window` keys up to its own position."""
    n, total = q.shape[0], k.shape[0]
    mask = None
    if window and total > window:
        mask = window_mask(start, n, total, window, q.device)
    elif n > 1 and start > 0:  # queries see keys up to their own position (a decode query sees everything)
        pos_q = torch.arange(start, start + n, device=q.device).unsqueeze(1)
        mask = torch.arange(total, device=q.device).unsqueeze(0) <= pos_q  # [n, total]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=mask is None and n > 1 and start == 0, enable_gqa=True,
    )  # [1, heads, n, d]
    return out[0].transpose(0, 1)


def window_mask(start: int, n: int, total: int, window: int, device) -> Tensor:
    """[n, total] True where query start + i sees key j: j <= start + i and j > start + i - window."""
    pos_q = torch.arange(start, start + n, device=device).unsqueeze(1)
    pos_k = torch.arange(total, device=device).unsqueeze(0)
    return (pos_k <= pos_q) & (pos_k > pos_q - window)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, window: int = 0) -> Tensor:
    """One new query per sequence, all sequences at once: q [S, heads, d]; k, v [S, L, kv_heads, d] padded
    past lengths[i] -> [S, heads, d].

    Two batched matmuls and a float32 softmax: 4x faster here than SDPA with a padding mask (which falls
    back to its unfused path) at 32 sequences."""
    s, heads, d = q.shape
    kv_heads = k.shape[2]
    if s == 1:
        first = max(0, int(lengths[0]) - window) if window else 0
        return _single_decode_attention(q, k[0, first : int(lengths[0])], v[0, first : int(lengths[0])])
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [S, kv_heads, L, d]: 1.6x faster than strided
    qg = q.view(s, kv_heads, heads // kv_heads, d)  # query heads grouped by the KV head they read
    scores = torch.matmul(qg, kt.transpose(2, 3)).float() * d**-0.5  # [S, kv_heads, group, L]
    pos = torch.arange(k.shape[1], device=q.device).unsqueeze(0)
    pad = pos >= lengths.unsqueeze(1)  # [S, L]
    if window:
        pad |= pos < (lengths - window).unsqueeze(1)
    probs = scores.masked_fill_(pad[:, None, None, :], float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(probs, vt).reshape(s, heads, d)


def _single_decode_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One sequence (the single-stream case): q [1, heads, d], k, v [L, kv_heads, d], no padding to mask.
    Float32 matmuls here: at these sizes bf16 ones cost twice as much (71 vs 129 us a layer at L=150)."""
    _, heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q[0].float().view(kv_heads, heads // kv_heads, d)
    probs = (torch.bmm(qg, k.float().permute(1, 2, 0)) * d**-0.5).softmax(-1)  # [kv_heads, group, L]
    return torch.bmm(probs, v.float().transpose(0, 1)).reshape(1, heads, d).to(q.dtype)


def dequantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """FP8 E4M3 -> `dtype` times `scale`, equal to `reference.dequantize_fp8` (NaN codes aside) at 3x its speed
    on CPU, where PyTorch converts float8 element by element.

    E4M3's sign, exponent and mantissa bits shifted into bfloat16's places read as the value times 2**-120
    (bias 7 vs 127; subnormals included, as both formats' subnormal rules agree), so one float32 multiply
    by scale * 2**120 finishes it with the reference's single rounding."""
    i = x.view(torch.uint8).to(torch.int16)
    bits = ((i & 0x7F) << 4) | ((i & 0x80) << 8)  # [..] bfloat16 bit patterns
    return (bits.view(torch.bfloat16).float() * (scale * 2.0**120)).to(dtype)
