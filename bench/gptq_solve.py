"""GPTQ's solve alone, on the 1.5B's four weight shapes: how the column updates' sub-block size pays.

    python bench/gptq_solve.py [--sub-blocks 128,32,16,8] [--shapes 17920x1536,1536x8960] [--repeats 2] [--json]

Each shape gets random weights and a Hessian of correlated inputs with uneven channel scales (4,096 tokens), then
`gptq()` at W4 g128 (static actorder, the default recipe) once per sub-block size, best of `--repeats`. A sub-block
of 128 is the whole block: every column's rank-1 update runs over all the block's later columns, as GPTQ's
reference code does. Printed per row: seconds, and the output error tr(dW H dW^T) relative to the first sub-block
size's, so the sizes are seen to solve the same problem (they differ only in the order of float32 sums).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quantkit.config import Scheme
from quantkit.quant.gptq import GPTQConfig, gptq

SHAPES = "17920x1536,1536x8960,2048x1536,1536x1536"  # gate/up stacked, down, q/k/v stacked, o


def problem(out: int, inp: int, tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(inp, inp, generator=g) / inp**0.5 + torch.eye(inp)
    x = (torch.randn(tokens, inp, generator=g) @ mix) * torch.linspace(0.2, 3.0, inp)
    return torch.randn(out, inp, generator=g) * 0.05, x.t() @ x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sub-blocks", default="128,32,16,8")
    ap.add_argument("--shapes", default=SHAPES, help="OUTxIN, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scheme = Scheme(4, 128, True)
    rows = []
    for shape in args.shapes.split(","):
        out, inp = map(int, shape.split("x"))
        w, h = problem(out, inp)
        first = None
        for sub in map(int, args.sub_blocks.split(",")):
            cfg = GPTQConfig(actorder=True, sub_block=sub)
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                qw = gptq(w, h, scheme, torch.bfloat16, cfg)
                best = min(best, time.perf_counter() - t0)
            d = qw.dequantize(torch.float32) - w
            err = torch.einsum("oi,ij,oj->", d, h, d).item()
            first = first or err
            rows.append({"shape": shape, "sub_block": sub, "seconds": round(best, 3), "error_ratio": round(err / first, 5)})
            if not args.json:
                print(f"{shape:>12}  sub-block {sub:>4}  {best:7.3f} s  error x{err / first:.5f}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
