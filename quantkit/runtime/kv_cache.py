"""The paged KV cache: per layer, keys and values in fixed-size blocks of token slots.

Stored in the compute dtype, or in FP8 E4M3 as k / k_scale with the checkpoint's calibrated scales
(per tensor [1] or per KV head [kv_heads, 1, 1]). Sized from a memory budget, so the number of tokens
that fit is known, and reported, before the first request.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import Tensor

from quantkit.kernels import cpu, reference


@dataclass(slots=True)
class CacheSpec:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage: a float dtype or torch.float8_e4m3fn

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Keys and values of one block in one layer."""
        return 2 * self.block_size * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def blocks_for(self, budget_bytes: int) -> int:
        return max(budget_bytes // self.bytes_per_block, 0)


@dataclass(slots=True, frozen=True)
class Ring:
    """A sliding-window layer keeps only a sequence's last tokens: its logical block b lives in block b mod `size` of
    the sequence's own run of `size` blocks (ring r: blocks r * size .. r * size + size - 1). `size` covers the window,
    the longest chunk a step writes and a verification's draft rows, so no key a query sees is overwritten first."""

    size: int  # blocks per sequence

    @classmethod
    def for_window(cls, window: int, chunk: int, block_size: int) -> Ring:
        return cls(-(-(window + chunk + 17) // block_size) + 1)  # 17: the most positions a verification writes

    def block(self, ring: int, b: int) -> int:
        return ring * self.size + b % self.size


class KVCache:
    def __init__(self, spec: CacheSpec, num_blocks: int, compute_dtype: torch.dtype, device: str,
                 scales: list[tuple[Tensor, Tensor]] | None = None, windowed: list[bool] | None = None,
                 ring_blocks: int = 0):
        """`windowed` layers (sliding-window attention) hold `ring_blocks` blocks: their sequences' rings."""
        self.spec, self.num_blocks, self.compute_dtype = spec, num_blocks, compute_dtype
        windowed = windowed or [False] * spec.num_layers
        shape = lambda w: (ring_blocks if w else num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
        self.k = [_zeros(shape(w), spec.dtype, device) for w in windowed]
        self.v = [_zeros(shape(w), spec.dtype, device) for w in windowed]
        self.bytes = sum(k.numel() for k in self.k) * 2 * torch.empty(0, dtype=spec.dtype).element_size()
        self.fp8 = spec.dtype == torch.float8_e4m3fn
        self.scales = scales  # per layer (k_scale, v_scale), float32, broadcastable to [.., kv_heads, head_dim]
        ones = torch.ones(spec.kv_heads, device=device)
        # the same per KV head [kv_heads] (ones without scales), as the fused CPU attention reads them
        self.head_scales = [(ones, ones)] * spec.num_layers if not self.fp8 else [
            tuple(s.float().reshape(-1).expand(spec.kv_heads).contiguous() for s in pair) for pair in scales]

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.spec.block_size

    def store(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write new keys/values [t, kv_heads, d] into their slots [t] (quantizing to FP8 on write)."""
        kc = self.k[layer].view(-1, self.spec.kv_heads, self.spec.head_dim)
        vc = self.v[layer].view(-1, self.spec.kv_heads, self.spec.head_dim)
        if self.fp8:
            ks, vs = self._scales(layer)
            k, v = reference.quantize_fp8(k, ks), reference.quantize_fp8(v, vs)
        kc[slots] = k.to(kc.dtype)
        vc[slots] = v.to(vc.dtype)

    def gather(self, layer: int, blocks: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """One sequence's first `length` keys and values [length, kv_heads, d], in the compute dtype."""
        k, v = self.gather_padded(layer, blocks.unsqueeze(0))
        return k[0, :length], v[0, :length]

    def gather_padded(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """Several sequences' keys and values [S, blocks * block_size, kv_heads, d] from block tables [S, blocks]."""
        s, nb = tables.shape
        shape = (s, nb * self.spec.block_size, self.spec.kv_heads, self.spec.head_dim)
        flat = tables.view(-1)  # index_select: 2-8x faster than advanced indexing with a 2-D table
        k, v = self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)
        if self.fp8:
            ks, vs = self._scales(layer)
            return cpu.dequantize_fp8(k, ks, self.compute_dtype), cpu.dequantize_fp8(v, vs, self.compute_dtype)
        if k.dtype != self.compute_dtype:  # a narrower cache than the compute (--dtype fp32 --kv-cache-dtype bf16)
            return k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    def _scales(self, layer: int) -> tuple[Tensor, Tensor]:
        ks, vs = self.scales[layer]
        return ks.reshape(-1, 1) if ks.numel() > 1 else ks, vs.reshape(-1, 1) if vs.numel() > 1 else vs


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Tensor:
    """Zeros that cost nothing until written. On CPU an anonymous mapping: the OS hands out zeroed pages as they
    are first touched, so a cache sized for the whole budget neither spends seconds clearing gigabytes at start
    nor holds memory its sequences have not reached. (torch.zeros writes every byte up front.)"""
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(count, 1))  # the tensor holds a reference: the mapping lives as long as it
    return torch.frombuffer(buf, dtype=torch.uint8, count=count).view(dtype).view(shape)
