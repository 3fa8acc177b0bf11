"""Decode time per step, A/B in one process: the runtime's PyTorch ops, the fused C++ decode ops with
PyTorch's matmuls (int4 op, oneDNN bf16 lm_head), the fused ops with quantkit's panel GEMM for both (the
default on CPUs with AVX-512 BF16), and that with the opt-in int8 lm_head; one sequence or `--batch` at once.

    python bench/runtime_decode_ab.py CKPT [--runs 5 --prompt-len 128 --output-len 64 --batch 1 --kv-cache-dtype auto]

The engines take turns, `--runs` generations each (`--batch` requests of `--prompt-len` tokens, then
`--output-len` greedy tokens with EOS ignored); a step's time is the wall time of the steps after every
request has its first token, over their count. Prints the min and median per engine: on a noisy machine
the min is the machine's own speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, bf16, ...: the same for every engine")
    args = ap.parse_args()

    from unittest import mock

    from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
    from quantkit.runtime.layers import linear

    def engine(panels: bool = True, **kw) -> LLMEngine:
        # without quantkit's panel GEMM the layers load for PyTorch's matmuls, as on a CPU without AVX-512 BF16
        off = contextlib.nullcontext() if panels else mock.patch.object(linear, "_panels_fit", lambda *a: False)
        with off:
            return LLMEngine(args.ckpt, EngineConfig(dtype="bf16", kv_cache_memory=512 << 20, kv_cache_dtype=args.kv_cache_dtype, **kw))

    engines = {"pytorch ops": engine(fused=False), "fused, pytorch matmuls": engine(panels=False), "fused": engine(),
               "fused + int8 lm_head": engine(lm_head="int8")}
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for run in range(args.runs):
        for name, engine in engines.items():
            ids = set()
            for i in range(args.batch):  # fresh token ids each run: no prefix-cache hits
                start = 1000 + 7 * (run * args.batch + i)
                ids.add(engine.add_request(list(range(start, start + args.prompt_len)), params))
            started: set[str] = set()
            while started != ids:  # the prefill (in chunks for long batches), up to every request's first token
                started |= {out.id for out in engine.step()}
            t, steps = time.perf_counter(), 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
            times[name].append((time.perf_counter() - t) / steps * 1e3)
    rows = {name: {"min_ms_per_step": min(v), "median_ms_per_step": statistics.median(v),
                   "tok_s_at_min": args.batch * 1e3 / min(v)} for name, v in times.items()}
    print(json.dumps({"batch": args.batch, "runs": args.runs, "kv_cache_dtype": args.kv_cache_dtype, "engines": rows}, indent=2))


if __name__ == "__main__":
    main()
