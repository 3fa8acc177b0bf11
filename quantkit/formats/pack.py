"""The one place that knows bit packing: compressed-tensors `pack-quantized` int32 words.

Signed values are offset to unsigned (+8 at 4 bits, +128 at 8 bits) and packed along one dimension,
element 0 in the lowest bits of a word: 8 nibbles or 4 bytes per int32. Weights pack along the input
dim (1); zero points pack along the output dim (0). 4 and 8 bits divide 32, so no value straddles words.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

SUPPORTED_BITS = (4, 8)


def pack_int32(values: Tensor, bits: int, dim: int = 1) -> Tensor:
    """values int8 [rows, cols] in [-2^(bits-1), 2^(bits-1)) -> int32 packed along `dim`."""
    per_word = _per_word(bits)
    v = values.to(torch.int64) + (1 << (bits - 1))  # [rows, cols], unsigned
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    pad = -cols % per_word
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(rows, -1, per_word)  # [rows, words, per_word]
    shifts = torch.arange(per_word, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(dim=-1)  # [rows, words], fits in 32 unsigned bits
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def unpack_int32(packed: Tensor, bits: int, length: int, dim: int = 1) -> Tensor:
    """int32 packed along `dim` -> int8 signed values; `length` is the unpacked size of `dim`."""
    per_word = _per_word(bits)
    w = packed.t() if dim == 0 else packed
    shifts = torch.arange(per_word, dtype=torch.int64, device=w.device) * bits
    v = (w.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    v = v.reshape(w.shape[0], -1)[:, :length] - (1 << (bits - 1))
    v = v.to(torch.int8)
    return (v.t() if dim == 0 else v).contiguous()


def unpack_int4_rows(packed: Tensor, length: int) -> Tensor:
    """Fast unpack of 4-bit weights packed along dim 1: int32 [rows, words] -> int8 [rows, length].

    On a little-endian machine the words' bytes hold the nibbles in element order (low nibble first), so
    two byte-wide masks replace `unpack_int32`'s 64-bit shifts: ~15x faster, for dequantising at run time."""
    if sys.byteorder != "little":
        return unpack_int32(packed, 4, length, dim=1)
    b = packed.contiguous().view(torch.uint8)  # [rows, words * 4]
    nibbles = torch.stack([b & 15, b >> 4], dim=-1).view(packed.shape[0], -1)[:, :length]
    return nibbles.to(torch.int8) - 8


def pack_int4_panels(q: Tensor, panel: int = 16) -> Tensor:
    """The CPU int4 GEMM's layout (kernels/csrc/panel_gemm.h): int8 [out, in] in [-8, 7], in % 8 == 0 -> uint8
    [out / panel, in / 8, 4 * panel]: line L of a panel is one little-endian dword per channel holding its inputs
    8L..8L+7 as u = q + 8, input 8L + 2i in bits 4i..4i+3 and 8L + 2i + 1 in bits 16 + 4i..19 + 4i. One 64-byte
    load then carries four pairs of inputs for all 16 channels, and a shift and a mask extract each pair."""
    return _nibble_panels((q.to(torch.int16) + 8).to(torch.uint8), panel)


def pack_int8_panels(q: Tensor, panel: int = 16) -> Tensor:
    """The same GEMM's 8-bit layout: int8 [out, in] -> uint8 [out / panel, in / 8, 8 * panel], each line of
    `pack_int4_panels` for the low nibbles of u = q + 128 followed by the line for its high nibbles."""
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return torch.cat([_nibble_panels(u & 15, panel), _nibble_panels(u >> 4, panel)], dim=-1)


def _nibble_panels(u: Tensor, panel: int) -> Tensor:
    """uint8 [out, in] in [0, 15] -> the panel lines described in `pack_int4_panels`."""
    out_features, in_features = u.shape
    u = u.view(out_features, in_features // 8, 8)  # input 8L + t at [:, L, t]
    dword = torch.stack([u[..., 0] | u[..., 2] << 4, u[..., 4] | u[..., 6] << 4,  # bytes 0, 1: the even inputs
                         u[..., 1] | u[..., 3] << 4, u[..., 5] | u[..., 7] << 4], dim=-1)  # bytes 2, 3: the odd ones
    return dword.view(out_features // panel, panel, in_features // 8, 4).transpose(1, 2).reshape(out_features // panel, in_features // 8, 4 * panel)


def packed_width(length: int, bits: int) -> int:
    return -(-length // _per_word(bits))


def _per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack-quantized supports {SUPPORTED_BITS} bits here, got {bits}")
    return 32 // bits
