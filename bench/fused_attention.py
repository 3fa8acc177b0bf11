"""Time the fused CPU decode attention (kernels/csrc/fused.cpp) alone, per layer call, bf16 and FP8 caches.

    python bench/fused_attention.py [--repeats 3]

Cases: one sequence of 300 tokens, 32 sequences of 145 (SmolLM2's shapes: 9 query heads, 3 KV heads of 64),
blocks scattered over a 4,096-block cache. Prints the best of `--repeats` means of 300 calls, in µs; the
cache stays hot, so this is the kernel's arithmetic, not the DRAM reads a real decode step also pays.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def best_mean_us(fn, call_args: tuple, repeats: int, calls: int = 300) -> float:
    for _ in range(10):
        fn(*call_args)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn(*call_args)
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from quantkit.kernels.fused import ops

    m = ops()
    if m is None:
        raise SystemExit("the fused CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    blocks, block, kv_heads, heads, d = 4096, 16, 3, 9, 64
    results = {}
    for seqs, length in ((1, 300), (32, 145)):
        tables = torch.randperm(blocks, generator=gen)[: seqs * 20].view(seqs, 20).contiguous()
        lengths, slots = torch.full((seqs,), length), tables[:, 0] * block
        q, empty, ones = torch.randn(seqs, heads, d, generator=gen).bfloat16(), torch.empty(0, dtype=torch.bfloat16), torch.ones(kv_heads)
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            kc = (torch.randn(blocks, block, kv_heads, d, generator=gen) * 0.1).to(dtype)
            vc = (torch.randn(blocks, block, kv_heads, d, generator=gen) * 0.1).to(dtype)

            call = (q, empty, empty, kc, vc, slots, tables, lengths, ones, ones)
            results[f"{seqs} x {length} tokens, {name} cache"] = round(best_mean_us(m.decode_attention, call, args.repeats), 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
