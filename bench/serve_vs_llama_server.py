"""`quantkit serve` against llama.cpp's `llama-server` under the same load, one server at a time.

    python bench/serve_vs_llama_server.py CKPT GGUF --llama-server PATH/llama-server [--levels 1,8,32]
        [--serve-args "" --serve-args "--lm-head int8"] [--llama-args "" --llama-args "-md DRAFT.gguf"]
        [--prompts FILE.jsonl --chat --no-ignore-eos]

Both get the same random prompts (sized in the checkpoint's own tokenizer), `--output-len` tokens each with EOS
ignored, streamed completions, at each concurrency level (4 requests per slot, at least 4). llama-server
runs continuous batching with `-np` = the largest level and 2 threads. Prints one table with the
output-token throughput ratios (quantkit / llama-server), one per quantkit variant (`--serve-args`) and
llama-server variant (`--llama-args`, e.g. a draft model). `--prompts` takes a JSONL file of {"prompt": ...}
rows instead of random ones (`--chat`: sent as a user message through each server's chat template).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

from pathlib import Path

from quantkit.bench.loadgen import LoadConfig, file_prompts, random_prompts, run_load
from quantkit.models import load_tokenizer, resolve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    proc.kill()
    sys.exit("server did not come up")


def measure(name: str, cmd: list[str], port: int, levels: list[int], prompts, cfg: LoadConfig) -> dict[int, object]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        out = {}
        for c in levels:
            n = max(4, 4 * c)
            s = asyncio.run(run_load(dataclasses.replace(cfg, url=url, concurrency=c, num_prompts=n), prompts[:n]))
            print(f"{name:12s} c={c:3d}: {s.completed}/{n} ok, {s.output_throughput:6.1f} output tok/s, "
                  f"TTFT p50 {s.ttft_ms['p50']:6.0f} ms, TPOT p50 {s.tpot_ms['p50']:5.1f} ms", flush=True)
            out[c] = s
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("gguf")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-args", action="append", default=None,
                    help="extra flags for quantkit serve, one quantkit run each (repeatable), e.g. '--lm-head int8'")
    ap.add_argument("--llama-args", action="append", default=None,
                    help="extra flags for llama-server, one run each (repeatable), e.g. '-md DRAFT.gguf --spec-draft-n-max 4'")
    ap.add_argument("--prompts", type=Path, help="JSONL rows with a 'prompt' field instead of random prompts")
    ap.add_argument("--chat", action="store_true", help="send chat completions (the prompt as a user message)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests end at EOS (compare TPOT then)")
    args = ap.parse_args()
    variants = args.serve_args or [""]
    levels = [int(x) for x in args.levels.split(",")]
    tok = load_tokenizer(resolve(args.ckpt).path)
    if args.prompts:
        rows = file_prompts(args.prompts, tok)
        prompts = [(t, n, args.output_len) for i in range(4 * max(levels)) for t, n, _ in [rows[i % len(rows)]]]
    else:
        prompts = [(t, n, args.output_len) for t, n in random_prompts(tok, 4 * max(levels), args.input_len, seed=0)]
    cfg = LoadConfig(url="", input_len=args.input_len, output_len=args.output_len, chat=args.chat, ignore_eos=not args.no_ignore_eos)
    slots = max(levels)
    ours = {}
    for extra in variants:
        port = free_port()
        ours[extra] = measure(f"quantkit {extra}".strip(), [sys.executable, "-m", "quantkit", "serve", args.ckpt, "--port", str(port),
                                                           "--max-num-seqs", str(slots), *shlex.split(extra)], port, levels, prompts, cfg)
    ctx = slots * (args.input_len + args.output_len + 64) + (4096 if args.prompts else 0)
    peers = {}
    for extra in args.llama_args or [""]:
        port = free_port()
        peers[extra] = measure(f"llama-server {extra}".strip(), [args.llama_server, "-m", args.gguf, "--port", str(port), "-np", str(slots),
                                                                "-c", str(ctx), "-t", str(args.threads), "-cb", *shlex.split(extra)],
                               port, levels, prompts, cfg)
    for extra, mine in ours.items():
        for peer_args, peer in peers.items():
            print(f"\nquantkit serve {extra}".rstrip() + f" against llama-server {peer_args}".rstrip())
            print("| concurrency | quantkit serve tok/s | llama-server tok/s | ratio | quantkit TTFT p50 ms | llama-server TTFT p50 ms |"
                  " quantkit TPOT p50 ms | llama-server TPOT p50 ms |")
            print("|---|---|---|---|---|---|---|---|")
            for c in levels:
                a, b = mine[c], peer[c]
                print(f"| {c} | {a.output_throughput:.1f} | {b.output_throughput:.1f} | {a.output_throughput / b.output_throughput:.2f}x | "
                      f"{a.ttft_ms['p50']:.0f} | {b.ttft_ms['p50']:.0f} | {a.tpot_ms['p50']:.1f} | {b.tpot_ms['p50']:.1f} |")


if __name__ == "__main__":
    main()
