"""Launch to first answer: `quantkit serve MODEL` started as a user starts it, timed until its first completion.

    python bench/cold_start.py CHECKPOINT [--runs 3] [--port 8471] [--json]

Each run starts a fresh server process on a loopback port, posts a one-token completion every 50 ms until one
succeeds, and reports the seconds from launch to that answer, the server's own "ready in" line (its split of
import, load, repack and warm-up), then stops it. The first run may include compiling the kernels (a first-ever
start says so); the runs after it are warm starts (kernels cached, checkpoint in the page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request


def first_answer(model: str, port: int, timeout: float) -> tuple[float, str]:
    """-> (seconds from launch to the first completion, the server's "ready in" line)."""
    cmd = [sys.executable, "-m", "quantkit", "serve", model, "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "400"})
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}: {proc.stdout.read().strip()[-400:]}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"no answer within {timeout:.0f} s")
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    if r.status == 200:
                        elapsed = time.perf_counter() - t0
                        break
            except urllib.error.HTTPError as e:  # the server is up and said no: not worth waiting for
                raise SystemExit(f"the server answered {e.code}: {e.read().decode()[:300]}") from None
            except OSError:  # not listening yet
                time.sleep(0.05)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    ready = next((line.strip() for line in out.splitlines() if "ready in" in line), "")
    return elapsed, ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        s, ready = first_answer(args.model, args.port, args.timeout)
        runs.append({"run": i + 1, "first_answer_s": round(s, 2), "ready": re.sub(r"^.*?ready", "ready", ready)})
        if not args.json:
            print(f"run {i + 1}: first answer {s:.2f} s after launch; {runs[-1]['ready'] or '(no ready line)'}", flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "runs": runs}))


if __name__ == "__main__":
    main()
