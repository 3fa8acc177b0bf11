"""What an FP8 KV cache costs in accuracy: KL(bf16 cache || FP8 cache) of the runtime's next-token
distributions on held-out text, with the checkpoint's calibrated scales and with scale 1.0.

    python bench/runtime_kv_fp8.py [--rows 16 --seqlen 512]

Quantizes SmolLM2-135M with `--method none --kv-cache fp8` (weights dense, KV scales calibrated on the
built-in corpus), then runs each held-out row through the engine's prefill (keys and values are written
to the cache and read back, so attention sees the FP8 values) with a bf16 cache and an FP8 one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def logits_per_row(engine, rows: torch.Tensor) -> list[torch.Tensor]:
    return [engine.model(engine.single(row, all_logits=True), engine.cache).log_softmax(-1) for row in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()

    from quantkit.calib.data import eval_rows
    from quantkit.runtime import EngineConfig, LLMEngine

    ckpt = Path(tempfile.mkdtemp(prefix="qk-kv-")) / "kv"
    subprocess.run([sys.executable, "-m", "quantkit", "quantize", "smollm2-135m", "--method", "none", "--kv-cache", "fp8",
                    "-o", str(ckpt), "-q"], check=True)
    engines = {name: LLMEngine(ckpt, EngineConfig(dtype="bf16", kv_cache_dtype=kv, kv_cache_memory=64 << 20))
               for name, kv in (("bf16", "bf16"), ("fp8", "fp8"))}
    rows = eval_rows(engines["bf16"].tokenizer, args.seqlen, args.rows)
    ref = logits_per_row(engines["bf16"], rows)
    results = {}
    for name, scales in (("fp8 calibrated scales", engines["fp8"].model.kv_scales), ("fp8 scale 1.0", None)):
        eng = engines["fp8"]
        eng.cache.scales = scales or [(torch.ones(1), torch.ones(1))] * eng.model.cfg.num_layers
        got = logits_per_row(eng, rows)
        kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref, got)])
        agree = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got)]).float().mean().item()
        results[name] = {"kl_mean": kl.mean().item(), "kl_p99": torch.quantile(kl.double(), 0.99).item(), "top1_agreement": agree}
    print(json.dumps({"tokens": rows.numel(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
