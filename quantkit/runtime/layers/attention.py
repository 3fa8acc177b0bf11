"""Attention over the paged KV cache: new keys/values are written to their slots, then each sequence's
queries attend over its own blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quantkit.kernels import cpu, reference
from quantkit.kernels import fused as fused_kernels
from quantkit import QuantkitError
from quantkit.runtime.kv_cache import KVCache, Ring


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a flattened batch."""

    offset: int  # first of its tokens in the batch
    n: int  # its new tokens this step
    start: int  # tokens already in the cache before this step (the first new token's position)
    blocks: Tensor  # int64 block ids covering start + n tokens


@dataclass(slots=True)
class Decodes:
    """The batch's single-token sequences, attended in one call: built once per step, used by every layer."""

    rows: Tensor  # [D] their tokens' positions in the batch
    tables: Tensor  # [D, max_blocks] block ids, padded with block 0 (masked out by `lengths`)
    lengths: Tensor  # [D] keys each one sees (its position + 1)

    @classmethod
    def of(cls, rows: list[int], tables: list[list[int]], lengths: list[int], device: str) -> Decodes | None:
        """From lists (tables of any lengths, padded here); None when there are no rows."""
        if not rows:
            return None
        width = max(map(len, tables))
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
        return cls(t(rows), t([b + [0] * (width - len(b)) for b in tables]), t(lengths))


@dataclass(slots=True)
class Batch:
    tokens: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    slots: Tensor  # [T] int64 cache slot of each new token
    seqs: list[SeqSlice]  # sequences with several new tokens (prefill chunks), or all of them without `decodes`
    logits_index: Tensor  # [S] batch positions whose next-token logits are wanted
    decodes: Decodes | None = None
    windowed: Batch | None = None  # the same tokens placed in the sliding-window layers' rings (kv_cache.Ring)
    scoring: bool = False  # a scoring pass: float32 logits, not rounded to the compute dtype (see Linear.exact)

    @classmethod
    def single(cls, tokens: Tensor, block_size: int, all_logits: bool = False, ring: Ring | None = None) -> Batch:
        """One sequence's tokens [n] prefilled into blocks 0, 1, ... (and ring 0): logits for a scoring pass
        (perplexity, KL) outside the scheduler; the last position's, or every position's with `all_logits`."""
        n = len(tokens)
        wanted = torch.arange(n) if all_logits else torch.tensor([n - 1])
        batch = cls(tokens, torch.arange(n), torch.arange(n), [SeqSlice(0, n, 0, torch.arange(-(-n // block_size)))], wanted,
                    scoring=all_logits)
        if ring is not None:
            if n > ring.size * block_size:
                raise QuantkitError(f"a row of {n} tokens is longer than a sliding-window ring ({ring.size * block_size})")
            blocks = torch.tensor([ring.block(0, b) for b in range(-(-n // block_size))])
            batch.windowed = cls(tokens, batch.positions, batch.positions, [SeqSlice(0, n, 0, blocks)], wanted)
        return batch


def paged_attention(layer: int, q: Tensor, k: Tensor, v: Tensor, batch: Batch, cache: KVCache, kernel: str,
                    fused: bool = False, window: int = 0) -> Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] of the new tokens -> [T, heads, d].

    Prefill chunks gather their context and attend with SDPA (or the reference); decodes attend all at once,
    on the Triton path and the fused CPU op reading the paged blocks in place (after a store that quantises on
    write; the fused op stores a pure-decode batch's keys itself). With a `window` (sliding-window layers) a query
    sees only the last `window` keys, its own included; those decodes go through the gathered PyTorch path."""
    d = batch.decodes
    if window:
        fused, kernel = False, "reference" if kernel == "reference" else "packed"
    if fused and d is not None and not batch.seqs:
        ks, vs = cache.head_scales[layer]
        return fused_kernels.ops().decode_attention(q, k, v, cache.k[layer], cache.v[layer], batch.slots, d.tables,
                                                    d.lengths, ks, vs)
    if kernel == "triton":
        from quantkit.kernels.triton.attention import paged_decode_attention, store_kv

        scales = cache.scales[layer] if cache.fp8 else (None, None)
        store_kv(k, cache.k[layer], batch.slots, scales[0])
        store_kv(v, cache.v[layer], batch.slots, scales[1])
    else:
        cache.store(layer, batch.slots, k, v)
    pure = not batch.seqs  # every token is a decode, in batch order: no scatter into `out`
    out = None if pure else torch.empty_like(q)
    attend = reference.attention if kernel == "reference" else cpu.attention
    for s in batch.seqs:
        keys, values = cache.gather(layer, s.blocks, s.start + s.n)
        out[s.offset : s.offset + s.n] = attend(q[s.offset : s.offset + s.n], keys, values, s.start, window)
    if d is None:
        return out
    qd = q if pure else q[d.rows]
    if fused:
        ks, vs = cache.head_scales[layer]
        empty = q.new_empty(0)  # stored above
        a = fused_kernels.ops().decode_attention(qd, empty, empty, cache.k[layer], cache.v[layer], batch.slots, d.tables,
                                                 d.lengths, ks, vs)
    elif kernel == "triton":
        a = paged_decode_attention(qd, cache.k[layer], cache.v[layer], d.tables, d.lengths, *scales)
    else:
        keys, values = cache.gather_padded(layer, d.tables)  # [D, max_blocks * block_size, kv_heads, d]
        batched = reference.decode_attention if kernel == "reference" else cpu.decode_attention
        a = batched(qd, keys, values, d.lengths, window)
    if pure:
        return a
    out[d.rows] = a
    return out
