"""The CPU matmuls of a SmolLM2 decode step, side by side: quantkit's panel GEMM (kernels/csrc/panel_gemm.h)
against PyTorch's int4 op and oneDNN's GEMM on dense copies, through the runtime's own `Linear` layers, in the
activation dtype the runtime picks for this CPU (bf16 with AVX512_BF16 or AMX, float32 elsewhere).

    python bench/panel_gemm.py [--model smollm2|qwen1.5b] [--dtype auto|bf16|fp32] [--rows 1,2,4,8,16,32,64]
                               [--prefill-rows 512,2048]

Three tables, ms (best of `--repeats`, the kernels taking turns):
- layers: 30 layers of SmolLM2-135M's shapes (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536),
  random int4 weights (group 64), distinct per layer as in a model; the panel GEMM (as the runtime calls it: in
  float32 above 32 rows, the weight dequantised from its panels and oneDNN's sgemm), PyTorch's int4 op (bf16
  only: with float32 activations it is ~30x slower and the runtime never uses it), and oneDNN on dense copies
  in the activation dtype (what holding the model unquantized would cost).
- prefill: one layer's four matmuls at prefill-sized row counts, the same columns; on a CPU with AMX also the
  runtime's path there (bf16 above AMX_PANEL_MAX_ROWS rows: the weight dequantised to bf16, oneDNN on AMX), the
  "panel" column then forced onto the panels.
- lm_head: the tied 49,152 x 576 head in bf16, oneDNN (on a float32 copy for float32 activations) vs the
  panel GEMM's bf16 panels.
Needs the fused CPU ops (a C++ compiler).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from unittest import mock

import torch

MODELS = {  # (qkv, o, gate/up, down) as [out, in]; layers, group, vocabulary, hidden
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, 64, 49152, 576),
    "qwen1.5b": ([(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], 28, 128, 151936, 1536),
}


def linear(weight, kernel_panels: bool, dtype: torch.dtype, **kw):
    from quantkit.runtime.layers import linear as lin

    off = nullcontext() if kernel_panels else mock.patch.object(lin, "_panels_fit", lambda *a: False)
    with off:
        return lin.Linear(weight, None, dtype, "packed", fused=True, **kw)


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
    ap.add_argument("--model", default="smollm2", choices=list(MODELS))
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefill-rows", default="512,2048")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()

    from quantkit.kernels import fused
    from quantkit.runtime.layers.linear import QuantWeight

    SHAPES, LAYERS, GROUP, VOCAB, HIDDEN = MODELS[args.model]

    if fused.ops() is None:
        raise SystemExit("bench/panel_gemm.py: needs the fused CPU ops (a C++ compiler)")
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and fused.native_bf16())
    dtype = torch.bfloat16 if bf16 else torch.float32
    if str(dtype).removeprefix("torch.") not in fused.panel_dtypes():
        raise SystemExit(f"bench/panel_gemm.py: this build's panel GEMM takes {fused.panel_dtypes()}, not {dtype}")
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            weights.append(QuantWeight.of(q, torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3, None, 4, GROUP))
    kinds = {"panel": [linear(w, True, dtype) for w in weights]}
    assert kinds["panel"][0].mode == "int4_panels"
    if bf16:
        kinds["pytorch int4"] = [linear(w, False, dtype) for w in weights]
        assert kinds["pytorch int4"][0].mode == "int4"
    dense = [w.dequantize(dtype) for w in weights]

    def layers(mods, m: int, part=slice(None)):
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in SHAPES}}
        if mods is dense:
            return lambda: [xs[w.shape[1]] @ w.T for w in dense[part]]
        return lambda: [mod(xs[w.shape[1]]) for mod, w in zip(mods[part], weights[part])]

    name = f"onednn dense {'bf16' if bf16 else 'fp32'}"
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "isa": fused.ops().isa(), "layers_ms": {}, "prefill_ms": {},
                 "lm_head_ms": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        out["layers_ms"][m] = best_ms({**{k: layers(v, m) for k, v in kinds.items()}, name: layers(dense, m)}, args.repeats)
    one = slice(0, len(SHAPES))  # the first layer's four matmuls
    amx = bf16 and fused.amx()
    for m in [int(r) for r in args.prefill_rows.split(",")]:
        fns = {**{k: layers(v, m, one) for k, v in kinds.items()}, name: layers(dense, m, one)}
        if amx:  # the runtime's path at these rows; the panel column forced onto the panels
            panel = fns["runtime: dequantised bf16 + AMX"] = fns["panel"]
            fns["panel"] = lambda: _no_amx(fused, panel)
        out["prefill_ms"][m] = best_ms(fns, max(2, args.repeats // 4))
    head_w = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()
    head = linear(head_w, True, dtype, head=True)
    assert head.mode == "bf16_panels"
    head_dense = head_w.to(dtype)
    for m in (1, 32):
        x = torch.randn(m, HIDDEN, generator=gen).to(dtype)
        out["lm_head_ms"][m] = best_ms({"onednn": lambda: x @ head_dense.T, "panel": lambda: head(x)}, args.repeats)
    print(json.dumps({k: tab if isinstance(tab, str) else {r: {n: round(v, 3) for n, v in t.items()} for r, t in tab.items()}
                      for k, tab in out.items()}, indent=2))


def _no_amx(fused, fn):
    with mock.patch.object(fused, "amx", lambda: False):
        return fn()


if __name__ == "__main__":
    main()
