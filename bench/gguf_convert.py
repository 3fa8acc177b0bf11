"""GGUF -> dense checkpoint: quantkit's streamed conversion against transformers' own loader, each in a fresh
process, peak RSS above the process's import baseline and wall time.

    python bench/gguf_convert.py qwen2.5-coder-1.5b        # a built-in alias or a .gguf path
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, tempfile
from pathlib import Path
import torch, transformers, gguf, safetensors  # the import baseline both paths share
from quantkit.memory import peak_rss_bytes

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

path, how, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
base, start = rss(), time.perf_counter()
if how == "quantkit":
    from quantkit.formats.gguf import convert
    convert(path, out, path.stem)
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
print(json.dumps({"how": how, "seconds": round(time.perf_counter() - start, 1), "import_baseline_mb": round(base / 1e6),
                  "peak_above_baseline_mb": round((peak_rss_bytes() - base) / 1e6)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a built-in alias or a .gguf file")
    ap.add_argument("--only", choices=["quantkit", "transformers"], help="run one path")
    args = ap.parse_args()

    from pathlib import Path

    from quantkit.builtin import BUILTINS, gguf_path
    from quantkit.models import cache_dir

    gguf = gguf_path(args.model, cache_dir(), print) if args.model in BUILTINS else Path(args.model)
    rows = []
    for how in [args.only] if args.only else ["quantkit", "transformers"]:
        with tempfile.TemporaryDirectory() as out:
            run = subprocess.run([sys.executable, "-c", CHILD, str(gguf), how, out], capture_output=True, text=True)
            if run.returncode:
                sys.exit(f"{how} failed: {run.stderr.strip().splitlines()[-1]}")
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{gguf.name} ({gguf.stat().st_size / 1e9:.2f} GB)")
    print(f"{'path':<14}{'seconds':>9}{'peak RSS above imports':>25}")
    for r in rows:
        print(f"{r['how']:<14}{r['seconds']:>9}{r['peak_above_baseline_mb']:>22} MB")


if __name__ == "__main__":
    main()
