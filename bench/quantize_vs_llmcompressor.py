"""Benchmark: quantkit vs llm-compressor quantizing the same model on the same calibration rows.

Both tools get SmolLM2-135M-Instruct (dense), the same calibration token rows (quantkit's built-in
corpus, written to a JSONL file for the peer), and W4A16 symmetric int4 with group 64 (128 does not
divide SmolLM2's width of 576). For each run it reports wall time, peak resident memory (measured the
same way for both: GNU time's maximum RSS of the child) and perplexity on quantkit's held-out split,
computed here with HF transformers loading every checkpoint. Prints a Markdown table.

    python bench/quantize_vs_llmcompressor.py --peer-python PEER_VENV/bin/python [--samples 64 --seqlen 512]

llm-compressor pins older transformers/torch, so it runs in its own virtual env (`--peer-python`);
without one, only quantkit's rows are measured.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Run cmd; (wall seconds, peak RSS bytes of the process, stdout). GNU time reports the max RSS."""
    start = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{run.stderr[-2000:]}")
    peak_kib = int(run.stderr.strip().splitlines()[-1])
    return wall, peak_kib * 1024, run.stdout


def perplexity(path: Path, rows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    from quantkit.eval.ppl import nll_per_row

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return math.exp(nll_per_row(model, rows).mean().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", help="python of a venv with llmcompressor installed")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-rows", type=int, default=16, help="held-out rows of --seqlen tokens for perplexity")
    ap.add_argument("--methods", default="rtn,gptq,awq", help="quantkit methods to run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from quantkit.calib.data import CalibConfig, build, eval_rows
    from quantkit.models import resolve

    dense = resolve("smollm2-135m").path
    tokenizer = AutoTokenizer.from_pretrained(dense)
    calib = build(CalibConfig(samples=args.samples, seqlen=args.seqlen), tokenizer)
    held_out = eval_rows(tokenizer, args.seqlen, args.eval_rows)
    work = Path(tempfile.mkdtemp(prefix="qk-bench-"))
    calib_file = work / "calib.jsonl"
    calib_file.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in calib.ids.tolist()))

    rows = [{"tool": "dense (bf16)", "method": "-", "wall_s": None, "peak_rss_bytes": None, "ppl": perplexity(dense, held_out)}]
    for method in args.methods.split(","):
        out = work / f"quantkit-{method}"
        cmd = [sys.executable, "-m", "quantkit", "quantize", "smollm2-135m", "-o", str(out), "--method", method,
               "-g", "64", "--calib-samples", str(args.samples), "--calib-seqlen", str(args.seqlen), "--json"]
        wall, peak, _ = timed(cmd)
        rows.append({"tool": "quantkit", "method": method, "wall_s": wall, "peak_rss_bytes": peak, "ppl": perplexity(out, held_out)})
    if args.peer_python:
        for method in ("rtn", "gptq"):
            out = work / f"llmc-{method}"
            cmd = [args.peer_python, str(HERE / "peer_llmcompressor.py"), "--model", str(dense), "--calib", str(calib_file),
                   "--method", method, "--group-size", "64", "--out", str(out), "--json"]
            wall, peak, _ = timed(cmd)
            rows.append({"tool": "llm-compressor", "method": method, "wall_s": wall, "peak_rss_bytes": peak,
                         "ppl": perplexity(out, held_out)})

    if args.json:
        print(json.dumps({"samples": args.samples, "seqlen": args.seqlen, "eval_tokens": held_out.numel(), "rows": rows}, indent=2))
        return
    print(f"SmolLM2-135M-Instruct, W4A16 sym g64, calibration {args.samples} x {args.seqlen} tokens (built-in corpus), "
          f"perplexity on {held_out.shape[0]} x {args.seqlen} held-out tokens, torch threads {torch.get_num_threads()}\n")
    print("| tool | method | wall time | peak memory | held-out ppl |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:.1f} s"
        peak = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 1e9:.2f} GB"
        print(f"| {r['tool']} | {r['method']} | {wall} | {peak} | {r['ppl']:.3f} |")
    ours = {r["method"]: r for r in rows if r["tool"] == "quantkit"}
    peer = {r["method"]: r for r in rows if r["tool"] == "llm-compressor"}
    for m in sorted(set(ours) & set(peer)):
        print(f"\n{m}: quantkit is {peer[m]['wall_s'] / ours[m]['wall_s']:.2f}x faster than llm-compressor "
              f"(wall), ppl {ours[m]['ppl']:.3f} vs {peer[m]['ppl']:.3f}")


if __name__ == "__main__":
    main()
