"""The one place that knows bit packing: compressed-tensors `pack-quantized` int32 words.

Signed values are offset to unsigned (+8 at 4 bits, +128 at 8 bits, 2^(bits-1) in general) and packed along one
dimension as one dense bit stream: element i at bits i*bits .. i*bits + bits - 1, low bits first, so element 0 sits
in the lowest bits of word 0 (8 nibbles or 4 bytes per int32). Weights pack along the input dim (1); zero points
pack along the output dim (0). 4 and 8 bits divide 32 and take the fast paths; other widths (5, 6: the budget's
in-between choices) straddle words, exactly as compressed-tensors' `pack_to_int32` writes them: 32 values in
`bits` words.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)


def pack_int32(values: Tensor, bits: int, dim: int = 1) -> Tensor:
    """values int8 [rows, cols] in [-2^(bits-1), 2^(bits-1)) -> int32 packed along `dim`."""
    per_word = _per_word(bits)
    v = values.t() if dim == 0 else values
    if bits not in (4, 8):
        return _pack_stream(v, bits).t().contiguous() if dim == 0 else _pack_stream(v, bits)
    rows, cols = v.shape
    pad = -cols % per_word
    if sys.byteorder == "little":  # a word's bytes in element order: write the bytes, read them as words
        u = (v.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)  # [rows, cols], unsigned
        u = torch.nn.functional.pad(u, (0, pad)) if pad else u
        b = u if bits == 8 else u[:, 0::2] | u[:, 1::2] << 4  # [rows, words * 4]
        words = b.contiguous().view(-1).view(torch.int32).view(rows, -1)
    else:
        v = v.to(torch.int64) + (1 << (bits - 1))
        v = (torch.nn.functional.pad(v, (0, pad)) if pad else v).reshape(rows, -1, per_word)  # [rows, words, per_word]
        shifts = torch.arange(per_word, dtype=torch.int64, device=v.device) * bits
        words = (v << shifts).sum(dim=-1)  # [rows, words], fits in 32 unsigned bits
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def unpack_int32(packed: Tensor, bits: int, length: int, dim: int = 1) -> Tensor:
    """int32 packed along `dim` -> int8 signed values; `length` is the unpacked size of `dim`.

    On a little-endian machine a word's bytes hold its values in element order (low bits first), so the
    bytes are read as they are (8 bits) or split by two byte-wide masks (4 bits): ~15x faster than shifting
    64-bit words, which is what loading a checkpoint and dequantising at run time spend."""
    per_word = _per_word(bits)
    w = packed.t() if dim == 0 else packed
    if bits not in (4, 8):
        v = _unpack_stream(w, bits, length)
        return v.t().contiguous() if dim == 0 else v
    if sys.byteorder == "little":
        b = w.contiguous().view(-1).view(torch.uint8).view(w.shape[0], -1)  # [rows, words * 4]
        v = b if bits == 8 else torch.stack([b & 15, b >> 4], dim=-1).view(w.shape[0], -1)
        v = (v[:, :length].to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    else:
        shifts = torch.arange(per_word, dtype=torch.int64, device=w.device) * bits
        v = (w.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
        v = (v.reshape(w.shape[0], -1)[:, :length] - (1 << (bits - 1))).to(torch.int8)
    return (v.t() if dim == 0 else v).contiguous()


def pack_int4_panels(q: Tensor, panel: int = 16) -> Tensor:
    """The CPU int4 GEMM's layout (kernels/csrc/panel_gemm.h): int8 [out, in] in [-8, 7], in % 8 == 0 -> uint8
    [out / panel, in / 8, 4 * panel]: line L of a panel is one little-endian dword per channel holding its inputs
    8L..8L+7 as u = q + 8, input 8L + 2i in bits 4i..4i+3 and 8L + 2i + 1 in bits 16 + 4i..19 + 4i. One 64-byte
    load then carries four pairs of inputs for all 16 channels, and a shift and a mask extract each pair."""
    return _nibble_panels((q.to(torch.int16) + 8).to(torch.uint8), panel)


def int4_panels_from_words(words: Tensor, panel: int = 16) -> Tensor:
    """`pack_int4_panels` straight from the checkpoint's 4-bit words int32 [out, in / 8] (in % 8 == 0): a word
    holds inputs 8L..8L+7 as u = q + 8 at nibbles 0..7, the panel line wants nibbles 0, 2, 4, 6, 1, 3, 5, 7;
    two delta swaps reorder them (arithmetic right shifts are harmless: the masks never take the sign fill).
    Loading a checkpoint then neither unpacks to int8 nor packs again."""
    x = words.contiguous()
    t = (x ^ (x >> 4)) & 0x00F000F0  # swap nibbles 1<->2 and 5<->6: 0 2 1 3 4 6 5 7
    x = x ^ t ^ (t << 4)
    t = (x ^ (x >> 8)) & 0x0000FF00  # swap bytes 1<->2: 0 2 4 6 1 3 5 7
    x = x ^ t ^ (t << 8)
    out_features, lines = x.shape
    x = x.view(out_features // panel, panel, lines).transpose(1, 2).contiguous()  # [out / panel, in / 8, panel]
    return x.view(torch.uint8).view(out_features // panel, lines, 4 * panel)


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


def _pack_stream(v: Tensor, bits: int) -> Tensor:
    """int8 [rows, cols] -> int32 [rows, ceil(cols * bits / 32)] for a width that does not divide 32: each run of 32
    values fills `bits` words; value j starts at bit j * bits of the run and spills into the next word when it
    crosses one (arithmetic on 64-bit words, so the byte order does not matter). Runs lie along the columns of
    [32, runs] / [bits, runs] tensors so that every step reads and writes contiguous rows."""
    rows, cols = v.shape
    u = torch.nn.functional.pad(v.to(torch.int64) + (1 << (bits - 1)), (0, -cols % 32)).reshape(-1, 32).t()  # [32, runs]
    words = torch.zeros(bits, u.shape[1], dtype=torch.int64, device=v.device)  # [bits, runs]
    for j in range(32):
        word, offset = divmod(j * bits, 32)
        words[word] |= (u[j] << offset) & 0xFFFFFFFF
        if offset + bits > 32:
            words[word + 1] |= u[j] >> (32 - offset)
    words = words.t().reshape(rows, -1)[:, :packed_width(cols, bits)]
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def _unpack_stream(w: Tensor, bits: int, length: int) -> Tensor:
    """The inverse of `_pack_stream`: int32 [rows, words] -> int8 [rows, length]."""
    rows, n = w.shape
    u = torch.nn.functional.pad(w.to(torch.int64) & 0xFFFFFFFF, (0, -n % bits)).reshape(-1, bits).t().contiguous()  # [bits, runs]
    out = torch.empty(32, u.shape[1], dtype=torch.int8, device=w.device)  # [32, runs]
    mask = (1 << bits) - 1
    for j in range(32):
        word, offset = divmod(j * bits, 32)
        value = u[word] >> offset
        if offset + bits > 32:
            value = value | (u[word + 1] << (32 - offset))
        out[j] = (value & mask) - (1 << (bits - 1))
    return out.t().reshape(rows, -1)[:, :length].contiguous()


def packed_width(length: int, bits: int) -> int:
    """int32 words that `length` values of `bits` take (a dense stream: 6 bits pack 16 values into 3 words)."""
    _per_word(bits)
    return -(-length * bits // 32)


def _per_word(bits: int) -> int:
    """Whole values a word holds (the fast paths' unit; a width that does not divide 32 also straddles words)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack-quantized supports 2 to 8 bits here, got {bits}")
    return 32 // bits
