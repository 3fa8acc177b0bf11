"""y = x @ dequant(W).T with W in the checkpoint's own packing: int32 words along the input dimension,
element 0 in the lowest bits, offset by 2^(bits-1); one scale (and optional zero point) per group."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _wqa16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G,
                  stride_xm, stride_wn, stride_sn, stride_ym,
                  BITS: tl.constexpr, HAS_ZP: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        words = tl.load(w_ptr + rn[:, None] * stride_wn + (rk[None, :] // PER_WORD), mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
        q = ((words >> ((rk[None, :] % PER_WORD) * BITS)) & MASK) - OFFSET  # [BLOCK_N, BLOCK_K] signed
        group = rk[None, :] // G
        scale = tl.load(s_ptr + rn[:, None] * stride_sn + group, mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        w = q.to(tl.float32)
        if HAS_ZP:
            zp = tl.load(z_ptr + rn[:, None] * stride_sn + group, mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
            w = w - zp.to(tl.float32)
        w = w * scale.to(tl.float32)
        if IEEE:  # float32 activations: no TF32 rounding
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:  # bf16/fp16 activations: tensor cores in their dtype, float32 accumulation
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def wqa16_linear(x: Tensor, packed: Tensor, scale: Tensor, zero_point: Tensor | None, bits: int, in_features: int) -> Tensor:
    """x [M, K]; packed int32 [N, K*bits/32]; scale [N, groups]; zero_point int8 [N, groups] or None -> [M, N]."""
    m, n = x.shape[0], packed.shape[0]
    group = in_features // scale.shape[1]
    x, scale = x.contiguous(), scale.contiguous()
    zp = zero_point.to(torch.int32).contiguous() if zero_point is not None else scale  # unused when HAS_ZP is False
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _wqa16_kernel[grid](x, packed, scale, zp, y, m, n, in_features, group, x.stride(0), packed.stride(0), scale.stride(0),
                        y.stride(0), BITS=bits, HAS_ZP=zero_point is not None, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32)
    return y
