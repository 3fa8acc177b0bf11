"""Seconds per scored row: what `quantkit eval --tasks ppl,kl` and a budget's held-out measurement spend per row.

    python bench/scoring_rows.py MODEL [MODEL ...] [--rows 2] [--seqlen 512] [--dtype bf16] [--json]

Each MODEL (a built-in name, a directory or a checkpoint) runs on quantkit's runtime as the scoring passes run it:
one held-out row of --seqlen tokens at a time through the engine's prefill, float32 logits at every position. The
first row includes the engine's first-call costs; the later rows are the steady rate. The CPU line says which
kernels ran (bf16 GEMMs are native only with AVX512_BF16 or AMX).
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def main() -> None:
    from quantkit.calib.data import eval_rows
    from quantkit.eval.backends import RuntimeBackend
    from quantkit.kernels.fused import native_bf16, native_isa
    from quantkit.models import load_tokenizer, resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", help="the runtime's compute dtype (eval's default: bf16)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    results = []
    for spec in args.models:
        path = resolve(spec).path
        rows = eval_rows(load_tokenizer(path), args.seqlen, args.rows)
        backend = RuntimeBackend(path, spec, dtype=args.dtype)
        times = []
        for i in range(len(rows)):
            t0 = time.perf_counter()
            backend.logits(rows[i : i + 1])
            times.append(round(time.perf_counter() - t0, 2))
        results.append({"model": spec, "dtype": args.dtype, "seqlen": args.seqlen, "row_s": times})
        del backend
    cpu = {"machine": platform.machine(), "isa": native_isa(), "native_bf16": native_bf16()}
    if args.json:
        print(json.dumps({"cpu": cpu, "results": results}, indent=2))
        return
    print(f"CPU: {cpu['machine']}, kernels {cpu['isa']}, native bf16: {cpu['native_bf16']}")
    for r in results:
        print(f"{r['model']}: {r['dtype']}, rows of {r['seqlen']} tokens, seconds per row: "
              + ", ".join(f"{t:.2f}" for t in r["row_s"]))


if __name__ == "__main__":
    from quantkit import QuantkitError

    try:
        main()
    except QuantkitError as e:  # an unknown model or too little held-out text: one line
        raise SystemExit(f"error: {e}") from None
