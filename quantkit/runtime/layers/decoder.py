"""The layer loop of a pure-decode step, run from C++ (kernels/csrc/fused.cpp, `Decoder`).

With 4-bit weights a CPU decode step is bound by call overhead more than by arithmetic: each layer is a
dozen calls, and the Python interpreter between them cost ~1/4 of a single-stream token. The C++ loop makes
the same calls (quantkit's panel GEMM, PyTorch's packed int4/int8 ops or a dense matmul, then the fused
norm, rotary, attention and SiLU ops) with the same roundings, so it changes speed, not outputs. Prefill
and mixed batches keep the Python layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantkit.kernels import fused as fused_kernels
from quantkit.runtime.kv_cache import KVCache
from quantkit.runtime.layers.attention import Batch
from quantkit.runtime.layers.linear import PACKED_MAX_ROWS, Linear, panel_max_rows

MODES = {"int4": 0, "int8": 1, "dense": 2, "int4_panels": 3, "int8_panels": 3}


class FusedDecoder:
    def __init__(self, decoder, max_rows: int):
        self.decoder, self.max_rows = decoder, max_rows

    @classmethod
    def build(cls, layers, heads: int, kv_heads: int, head_dim: int, eps: float) -> FusedDecoder | None:
        """None unless every layer is one the C++ loop runs: CPU-kernel linears, no q/k norms (Qwen3)."""
        linears = [(l.qkv, l.o, l.gate_up, l.down) for l in layers]
        if not layers or any(l.q_norm is not None for l in layers) or any(lin.mode not in MODES for g in linears for lin in g):
            return None
        ops = fused_kernels.ops()
        decoder = ops.Decoder(heads, kv_heads, head_dim, eps)
        for layer, group in zip(layers, linears):
            decoder.add_layer(*[_spec(ops, lin) for lin in group], layer.input_norm.weight, layer.post_norm.weight)
        # int4 layers switch to a dense GEMM above PACKED_MAX_ROWS rows, panels above panel_max_rows
        # (linear.py): there the Python layers run
        modes = {lin.mode for g in linears for lin in g}
        panels = modes & {"int4_panels", "int8_panels"}
        return cls(decoder, PACKED_MAX_ROWS if "int4" in modes else panel_max_rows(layers[0].qkv.dtype) if panels else 1 << 30)

    def runs(self, batch: Batch) -> bool:
        return batch.decodes is not None and not batch.seqs and len(batch.tokens) <= self.max_rows

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, batch: Batch, cache: KVCache) -> Tensor:  # x [S, hidden]
        d = batch.decodes
        return self.decoder.forward(x, cos, sin, batch.slots, d.tables, d.lengths, cache.k, cache.v,
                                    [s[0] for s in cache.head_scales], [s[1] for s in cache.head_scales])


def _spec(ops, lin: Linear):
    if lin.mode == "int4":
        return ops.Linear(0, lin.packed, lin.scales_zeros, lin.group, lin.bias)
    if lin.mode in ("int4_panels", "int8_panels"):
        return ops.Linear(4 if lin.int8_activations else 3, lin.packed, lin.params, lin.group, lin.bias)
    if lin.mode == "int8":
        return ops.Linear(1, lin.q8, lin.scale8, 0, lin.bias)
    return ops.Linear(2, lin.weight, lin.weight, 0, lin.bias)
