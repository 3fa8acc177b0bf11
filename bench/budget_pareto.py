"""Size against measured mean KL (and perplexity) for checkpoints of one baseline, on the same held-out tokens.

Each candidate is any MODEL quantkit resolves: a quantkit checkpoint, or a llama.cpp GGUF (dequantized once to a dense
checkpoint, as transformers' GGUF loader reads it, so its KL is what its quantization cost). The baseline's logits are
computed once and kept (float32: rows x seqlen x vocab x 4 bytes, 5 GB for a 152k vocabulary at 16 x 512), and every
candidate, loaded one at a time, is compared with them; sizes are the candidate's files on disk (a GGUF's
own size). Prints a table, writes JSON and a PNG. Usage:

    python bench/budget_pareto.py --baseline smollm2-135m --out pareto \\
        w4-rtn=OUT-W4 w4-gptq=OUT-GPTQ w8=OUT-W8 Q4_K_M=model-Q4_K_M.gguf kl=0.05=OUT-KL05 ...
    python bench/budget_pareto.py --baseline smollm2-135m --out pareto2 --with pareto/pareto.json kl=0.02=OUT-KL02
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch


def size_of(spec: str) -> int:
    path = Path(spec)
    if path.suffix == ".gguf":
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def linear_bits(spec: str) -> float | None:
    path = Path(spec)
    if path.suffix == ".gguf" or not (path / "config.json").is_file():
        return None
    from quantkit.formats.inspect import inspect_checkpoint

    return inspect_checkpoint(path).linear_bits


def main() -> None:
    from quantkit.calib.data import eval_rows
    from quantkit.eval.backends import RuntimeBackend
    from quantkit.eval.kl import token_stats
    from quantkit.models import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--out", type=Path, default=Path("pareto"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--with", dest="earlier", type=Path, action="append", default=[],
                    help="an earlier run's pareto.json to show beside these (kept only if its baseline ppl and token "
                         "count are this run's: the same baseline and held-out tokens)")
    ap.add_argument("candidates", nargs="+", help="NAME=MODEL")
    args = ap.parse_args()

    base = RuntimeBackend(resolve(args.baseline).path, "baseline", dtype=args.dtype)
    rows = eval_rows(base.tokenizer, args.seqlen, args.rows).split(1)
    reference = [base.logits(row[:, :-1]) for row in rows]  # float32, kept: candidates are loaded one at a time
    del base
    named = [c.rsplit("=", 1) for c in args.candidates]
    stats, nll_base = {}, []
    for name, spec in named:
        model = RuntimeBackend(resolve(spec).path, name, dtype=args.dtype)
        stats[name] = {"kl": [], "nll": []}
        for row, ref in zip(rows, reference):
            kl, _, nll_b, nll_q = token_stats(ref, model.logits(row[:, :-1]), row[:, 1:])
            stats[name]["kl"].append(kl.flatten())
            stats[name]["nll"].append(nll_q.flatten())
            if len(nll_base) < len(rows):
                nll_base.append(nll_b.flatten())
        del model
        print(f"{name}: mean KL {torch.cat(stats[name]['kl']).mean().item():.4f}", flush=True)
    ppl_base = math.exp(torch.cat(nll_base).double().mean().item())
    results = []
    for name, spec in named:
        kl = torch.cat(stats[name]["kl"])
        results.append({"name": name, "model": spec, "bytes": size_of(spec), "linear_bits": linear_bits(spec),
                        "kl_mean": kl.mean().item(), "ppl": math.exp(torch.cat(stats[name]["nll"]).double().mean().item()),
                        "ppl_baseline": ppl_base, "tokens": kl.numel()})
    for earlier in args.earlier:
        for r in json.loads(earlier.read_text()):
            same = abs(r["ppl_baseline"] - ppl_base) < 1e-6 * ppl_base and r["tokens"] == results[0]["tokens"]
            if not same:
                raise SystemExit(f"{earlier}: {r['name']} was measured on other tokens or another baseline")
            if r["name"] not in {x["name"] for x in results}:
                results.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pareto.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n| checkpoint | size (MB) | bits / Linear weight | mean KL | ppl (baseline {ppl_base:.3f}) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in sorted(results, key=lambda r: r["bytes"]):
        bits = "-" if r["linear_bits"] is None else f"{r['linear_bits']:.2f}"
        print(f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {bits} | {r['kl_mean']:.4f} | {r['ppl']:.3f} |")
    plot(results, args.out / "pareto.png", args.baseline)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        kind = "o" if any(k in r["name"] for k in ("kl=", "bits=", "size=")) else ("s" if r["model"].endswith(".gguf") else "^")
        ax.scatter(r["bytes"] / 1e6, r["kl_mean"], marker=kind)
        ax.annotate(r["name"], (r["bytes"] / 1e6, r["kl_mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("checkpoint size (MB)")
    ax.set_ylabel("mean KL to the baseline (nats / token)")
    ax.set_yscale("log")
    ax.set_title(f"{title}: size against KL (circles: budgeted mixes, squares: llama.cpp, triangles: uniform)")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
