"""Benchmark: quantkit vs llm-compressor quantizing the same model on the same calibration rows.

Both tools get the same dense model (`--model`, default SmolLM2-135M-Instruct), the same calibration token
rows (quantkit's built-in corpus, written to a JSONL file for the peer), and W4A16 symmetric int4 with
`--group-size` (64 for SmolLM2: 128 does not divide its width of 576). For each run it reports wall time,
peak resident memory (measured the same way for both: GNU time's maximum RSS of the child), and on
quantkit's held-out split the perplexity and mean KL against the dense model, computed here with HF
transformers (float32) loading every checkpoint. Prints a Markdown table, and for each method both ran the
difference of the two KLs with a paired interval over the held-out rows (`--eval-rows`: the mean KL of 16 rows
cannot tell two GPTQs apart; the checkpoints stay in the printed work folder, and `--rescore WORK` scores them
again, on more rows, without quantizing: no wall time or memory then).

    python bench/quantize_vs_llmcompressor.py --peer-python PEER_VENV/bin/python [--samples 64 --seqlen 512]
    python bench/quantize_vs_llmcompressor.py --model qwen2.5-coder-1.5b --group-size 128 --methods gptq --peer-python ...

llm-compressor pins older transformers/torch, so it runs in its own virtual env (`--peer-python`);
without one, only quantkit's rows are measured.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def accuracy(dense: Path, path: Path, rows: torch.Tensor):
    """The checkpoint against the dense model on the held-out rows, both in float32: a `Distribution` (perplexities,
    per-token KL(dense || checkpoint) in nats)."""
    from quantkit.eval.backends import HFBackend
    from quantkit.eval.kl import distribution

    d = distribution(HFBackend(dense, "dense", torch.float32), HFBackend(path, "quantized", torch.float32), rows)
    gc.collect()  # the two float32 models (14 GB at 1.5B) go before the next tool runs beside this process
    return d


def kl_difference(ours: list[float], peer: list[float]) -> str:
    """quantkit's mean KL minus the peer's on the same held-out rows, with a 90% paired-bootstrap interval over rows:
    "lower" or "higher" only when the interval excludes zero, else "level" (more rows would be needed to decide)."""
    from quantkit.eval.stats import paired_bootstrap_ci

    a, b = torch.tensor(peer), torch.tensor(ours)
    lo, hi = paired_bootstrap_ci(a, b)
    word = "lower" if hi < 0 else "higher" if lo > 0 else "level"
    return (f"KL difference {(b - a).mean().item():+.4f} [{lo:+.4f}, {hi:+.4f}] (90% paired bootstrap over "
            f"{len(ours)} rows; quantkit lower on {int((b < a).sum())}): {word}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", help="python of a venv with llmcompressor installed")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-rows", type=int, default=16, help="held-out rows of --seqlen tokens for perplexity")
    ap.add_argument("--methods", default="rtn,gptq,awq", help="quantkit methods to run")
    ap.add_argument("--peer-methods", default="rtn,gptq", help="llm-compressor methods to run")
    ap.add_argument("--model", default="smollm2-135m", help="any MODEL quantkit resolves (the dense baseline)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rescore", metavar="WORK", help="score the checkpoints kept in an earlier run's work folder "
                    "(its {tool}-{method} folders) instead of quantizing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from quantkit.calib.data import CalibConfig, build, eval_rows
    from quantkit.models import resolve

    dense = resolve(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(dense)
    held_out = eval_rows(tokenizer, args.seqlen, args.eval_rows)
    work = Path(args.rescore) if args.rescore else Path(tempfile.mkdtemp(prefix="qk-bench-"))
    print(f"work folder (calibration rows, checkpoints): {work}", file=sys.stderr, flush=True)
    calib_file = work / "calib.jsonl"
    if not args.rescore:
        calib = build(CalibConfig(samples=args.samples, seqlen=args.seqlen), tokenizer)
        calib_file.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in calib.ids.tolist()))

    rows = [{"tool": "dense (bf16)", "method": "-", "wall_s": None, "peak_rss_bytes": None, "ppl": None, "kl": 0.0,
             "kl_rows": None}]  # its ppl: from the first comparison (the same float32 forwards)
    runs = [("quantkit", m, [sys.executable, "-m", "quantkit", "quantize", str(dense), "-o", str(work / f"quantkit-{m}"),
                             "--method", m, "-g", str(args.group_size),  # the built-in corpus: the same rows as calib_file
                             "--calib-samples", str(args.samples), "--calib-seqlen", str(args.seqlen), "--json"])
            for m in filter(None, args.methods.split(","))]
    if args.peer_python:
        runs += [("llm-compressor", m, [args.peer_python, str(HERE / "peer_llmcompressor.py"), "--model", str(dense),
                                        "--calib", str(calib_file), "--method", m, "--group-size", str(args.group_size),
                                        "--out", str(work / f"llm-compressor-{m}"), "--json"])
                 for m in filter(None, args.peer_methods.split(","))]
    if not runs:
        raise SystemExit("nothing to run: give --methods and/or --peer-methods with --peer-python")
    if args.rescore:
        runs = [(tool, method, None) for tool, method, _ in runs if (work / f"{tool}-{method}").is_dir()]
    for tool, method, cmd in runs:
        wall, peak = timed(cmd)[:2] if cmd else (None, None)
        d = accuracy(dense, work / f"{tool}-{method}", held_out)
        rows[0]["ppl"] = d.ppl_baseline
        rows.append({"tool": tool, "method": method, "wall_s": wall, "peak_rss_bytes": peak, "ppl": d.ppl_quantized,
                     "kl": d.kl_mean, "kl_rows": d.kl_per_token.view(held_out.shape[0], -1).mean(dim=1).tolist(),
                     "checkpoint": str(work / f"{tool}-{method}")})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kl_rows"}), file=sys.stderr, flush=True)

    if args.json:
        print(json.dumps({"samples": args.samples, "seqlen": args.seqlen, "eval_tokens": held_out.numel(), "rows": rows}, indent=2))
        return
    print(f"{args.model}, W4A16 sym g{args.group_size}, calibration {args.samples} x {args.seqlen} tokens (built-in corpus), "
          f"perplexity and KL on {held_out.shape[0]} x {args.seqlen} held-out tokens, torch threads {torch.get_num_threads()}\n")
    print("| tool | method | wall time | peak memory | held-out ppl | mean KL |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:.1f} s"
        peak = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 1e9:.2f} GB"
        print(f"| {r['tool']} | {r['method']} | {wall} | {peak} | {r['ppl']:.3f} | {r['kl']:.4f} |")
    ours = {r["method"]: r for r in rows if r["tool"] == "quantkit"}
    peer = {r["method"]: r for r in rows if r["tool"] == "llm-compressor"}
    for m in sorted(set(ours) & set(peer)):
        speed = "" if args.rescore else (f"quantkit is {peer[m]['wall_s'] / ours[m]['wall_s']:.2f}x faster than "
                                         "llm-compressor (wall), ")
        print(f"\n{m}: {speed}ppl {ours[m]['ppl']:.3f} vs {peer[m]['ppl']:.3f}, KL {ours[m]['kl']:.4f} vs {peer[m]['kl']:.4f}; "
              + kl_difference(ours[m]["kl_rows"], peer[m]["kl_rows"]))


if __name__ == "__main__":
    main()
