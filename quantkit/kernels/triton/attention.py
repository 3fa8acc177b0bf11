"""Paged decode attention and the KV store, over caches laid out [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, ks_ptr, vs_ptr, out_ptr, sm_scale,
                   stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_ts, KS_PER_HEAD: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr):
    """One program per (sequence, query head): online softmax over the sequence's blocks."""
    s, h = tl.program_id(0), tl.program_id(1)
    kvh = h // GROUP
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + s * stride_qs + h * stride_qh + d).to(tl.float32)
    length = tl.load(lengths_ptr + s)
    ks = 1.0
    vs = 1.0
    if SCALED:
        ks = tl.load(ks_ptr + kvh * KS_PER_HEAD).to(tl.float32)
        vs = tl.load(vs_ptr + kvh * KS_PER_HEAD).to(tl.float32)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for b in range(tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(tables_ptr + s * stride_ts + b)
        pos = b * BLOCK_SIZE + t
        valid = pos < length
        offs = block * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32) * ks
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32) * vs
        scores = tl.sum(k * q[None, :], axis=1) * sm_scale
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + s * stride_qs + h * stride_qh + d, (acc / l_i).to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                           k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """q [S, heads, d]; caches [blocks, block_size, kv_heads, d]; tables [S, max_blocks]; lengths [S]
    -> [S, heads, d]. FP8 caches are read with their scales (per tensor [1] or per KV head)."""
    s, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    scaled = k_scale is not None
    ks = k_scale.reshape(-1).float().contiguous() if scaled else q
    vs = v_scale.reshape(-1).float().contiguous() if scaled else q
    per_head = 1 if scaled and ks.numel() > 1 else 0
    _decode_kernel[(s, heads)](q, k_cache, v_cache, tables.contiguous(), lengths.contiguous(), ks, vs, out, d**-0.5,
                               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                               tables.stride(0), KS_PER_HEAD=per_head, GROUP=heads // kv_heads, BLOCK_SIZE=block_size,
                               HEAD_DIM=d, SCALED=scaled)
    return out


@triton.jit
def _store_kernel(x_ptr, cache_ptr, slots_ptr, scale_ptr, stride_xt, stride_xh, stride_cslot, stride_ch,
                  KS_PER_HEAD: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d).to(tl.float32)
    slot = tl.load(slots_ptr + t)
    if FP8:
        scale = tl.load(scale_ptr + h * KS_PER_HEAD).to(tl.float32)
        x = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    tl.store(cache_ptr + slot * stride_cslot + h * stride_ch + d, x.to(cache_ptr.dtype.element_ty))


def store_kv(x: Tensor, cache: Tensor, slots: Tensor, scale: Tensor | None = None) -> None:
    """x [T, kv_heads, d] into cache [blocks, block_size, kv_heads, d] at flat slots [T]; FP8 caches
    store x / scale, saturated to +-448."""
    t, kv_heads, d = x.shape
    x = x.contiguous()
    flat = cache.view(-1, kv_heads, d)
    fp8 = cache.dtype == torch.float8_e4m3fn
    sc = scale.reshape(-1).float().contiguous() if fp8 else x
    per_head = 1 if fp8 and sc.numel() > 1 else 0
    _store_kernel[(t, kv_heads)](x, flat, slots.contiguous(), sc, x.stride(0), x.stride(1), flat.stride(0),
                                 flat.stride(1), KS_PER_HEAD=per_head, HEAD_DIM=d, FP8=fp8)
