"""KV-cache memory one sequence holds in the runtime, with sliding-window layers kept as rings of the window.

Runs one long prompt through the engine (one sequence, greedy, one output token), records the most blocks the
sequence held during it, and prints the bytes its KV cache took against what it would take if every layer kept
every token. Usage:

    python bench/sliding_window_memory.py gemma-3-270m --tokens 32000
"""

from __future__ import annotations

import argparse
import time

import torch

from quantkit.models import resolve
from quantkit.runtime.engine import EngineConfig, LLMEngine
from quantkit.runtime.sampler import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32000, help="prompt length")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    engine = LLMEngine(resolve(args.model).path, EngineConfig(dtype=args.dtype, max_num_seqs=1, kv_cache_memory=None))
    m, spec = engine.model.cfg, engine.cache.spec
    if engine.ring is None:
        raise SystemExit(f"{args.model} has no sliding-window layers")
    windowed = sum(w > 0 for w in m.windows)
    prompt = torch.randint(10, m.vocab_size - 10, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.blocks.num_used)
    seconds = time.perf_counter() - start
    per_layer_block = spec.layer_block_bytes
    held = peak * per_layer_block * (m.num_layers - windowed) + engine.ring.size * per_layer_block * windowed
    every = peak * per_layer_block * m.num_layers
    print(engine.describe())
    print(f"{args.model}: one sequence of {args.tokens:,} prompt tokens, {m.num_layers} layers ({windowed} sliding-window, "
          f"window {max(m.windows)}), {str(spec.dtype).removeprefix('torch.')} KV cache; prefill {seconds:.1f} s")
    print(f"| KV cache of the sequence | MiB |\n| --- | ---: |")
    print(f"| every layer keeps every token | {every / 2**20:,.1f} |")
    print(f"| sliding-window layers keep a ring of {engine.ring.size * spec.block_size:,} tokens | {held / 2**20:,.1f} |")
    print(f"saved: {every - held:,} bytes, {100 * (every - held) / every:.1f}%")


if __name__ == "__main__":
    main()
