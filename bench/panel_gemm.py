"""The CPU matmuls of a SmolLM2 decode step, side by side: quantkit's panel GEMM (kernels/csrc/panel_gemm.h)
against PyTorch's int4 op and oneDNN's bf16 GEMM, through the runtime's own `Linear` layers.

    python bench/panel_gemm.py [--rows 1,2,4,8,16,32,64] [--prefill-rows 512,2048] [--repeats 8]

Three tables, ms (best of `--repeats`, the kernels taking turns):
- layers: 30 layers of SmolLM2-135M's shapes (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536),
  random int4 weights (group 64), distinct per layer as in a model; int4 op vs panel GEMM, and oneDNN on
  dense bf16 copies (what holding the model unquantized would cost).
- prefill: one layer's four matmuls at prefill-sized row counts; the panel GEMM vs the int4 checkpoint
  dequantized per call (the runtime's former path above 32 rows) then oneDNN, and oneDNN on dense weights.
- lm_head: the tied 49,152 x 576 head in bf16, oneDNN vs the panel GEMM's bf16 panels.
Needs the fused CPU ops and a CPU with AVX-512 BF16.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from unittest import mock

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate/up, down
LAYERS, GROUP, VOCAB, HIDDEN = 30, 64, 49152, 576


def linear(weight, kernel_panels: bool, **kw):
    from quantkit.runtime.layers import linear as lin

    off = nullcontext() if kernel_panels else mock.patch.object(lin, "_panels_fit", lambda *a: False)
    with off:
        return lin.Linear(weight, None, torch.bfloat16, "packed", fused=True, **kw)


def best_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Each fn run once per round, the rounds `repeats` times: the best round per fn, in ms."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefill-rows", default="512,2048")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()

    from quantkit.kernels import cpu, fused
    from quantkit.formats.pack import pack_int32
    from quantkit.runtime.layers.linear import QuantWeight

    ops = fused.ops()
    if ops is None or not ops.panel_gemm_available():
        raise SystemExit("bench/panel_gemm.py: needs the fused CPU ops and AVX-512 BF16")
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            weights.append(QuantWeight.of(q, torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3, None, 4, GROUP))
    panels = [linear(w, True) for w in weights]
    int4 = [linear(w, False) for w in weights]
    dense = [w.dequantize(torch.bfloat16) for w in weights]
    assert panels[0].mode == "int4_panels" and int4[0].mode == "int4"

    def layers(mods, m: int, dense_mm: bool = False):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, k in SHAPES}}
        if dense_mm:
            return lambda: [xs[w.shape[1]] @ w.T for w in mods]
        return lambda: [mod(xs[w.shape[1]]) for mod, w in zip(mods, weights)]

    out: dict = {"layers_ms": {}, "prefill_ms": {}, "lm_head_ms": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        out["layers_ms"][m] = best_ms({"pytorch int4": layers(int4, m), "panel": layers(panels, m),
                                       "onednn dense bf16": layers(dense, m, dense_mm=True)}, args.repeats)
    one = slice(0, len(SHAPES))  # the first layer's four matmuls
    words = [(pack_int32(w.q, 4, dim=1), w.scale.bfloat16()) for w in weights[one]]
    for m in [int(r) for r in args.prefill_rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, k in SHAPES}}
        out["prefill_ms"][m] = best_ms({
            "panel": lambda: [mod(xs[w.shape[1]]) for mod, w in zip(panels[one], weights[one])],
            "dequantize + onednn": lambda: [xs[w.shape[1]] @ cpu.dequant_int4(wd, s, None, w.shape[1], torch.bfloat16).T
                                            for (wd, s), w in zip(words, weights[one])],
            "onednn dense bf16": lambda: [xs[w.shape[1]] @ w.T for w in dense[one]]}, max(2, args.repeats // 4))
    head_w = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()
    head = linear(head_w, True, head=True)
    assert head.mode == "bf16_panels"
    for m in (1, 32):
        x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
        out["lm_head_ms"][m] = best_ms({"onednn": lambda: x @ head_w.T, "panel": lambda: head(x)}, args.repeats)
    print(json.dumps({k: {r: {n: round(v, 3) for n, v in t.items()} for r, t in tab.items()} for k, tab in out.items()}, indent=2))


if __name__ == "__main__":
    main()
