"""What an eval leaves behind: results.json (every item, both models), report.md, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.eval.runner import EvalReport
from quantkit.formats.save import atomic_file


def fmt(row: dict, key: str) -> str:
    v = row[key]
    if v is None:
        return "-"
    if row["task"] == "ppl" and key in ("baseline", "quantized"):
        return f"{v:.3f}"
    if row["task"] in ("kl", "budget"):
        return f"{v:+.4f}" if key == "diff" else f"{v:.4f}"
    return f"{v:+.1%}" if key == "diff" else f"{v:.1%}"


def ci_text(row: dict) -> str:
    return "-" if not row["ci"] else f"[{row['ci'][0]:+.1%}, {row['ci'][1]:+.1%}]"


def markdown(report: EvalReport) -> str:
    lines = [f"# quantkit eval: {report.checkpoint} vs {report.baseline}", "",
             "| task | baseline | quantized | diff | 90% CI | verdict | n | note |", "| --- | ---: | ---: | ---: | --- | --- | ---: | --- |"]
    for r in report.summary:
        lines.append(f"| {r['task']} | {fmt(r, 'baseline')} | {fmt(r, 'quantized')} | {fmt(r, 'diff')} | {ci_text(r)} | "
                     f"**{r['verdict']}** | {r['n']} | {r['note']} |")
    if "retrieval" in report.details:
        lines += ["", "## Retrieval by context length", "", "| tokens | baseline | quantized |", "| ---: | ---: | ---: |"]
        for n, v in report.details["retrieval"]["by_length"].items():
            lines.append(f"| {n} | {v['baseline']:.1%} | {v['quantized']:.1%} |")
    if "tool_use" in report.details:
        lines += ["", "## Tool use sub-scores", "", "| model | parse rate | function choice | arguments | abstention |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for who, s in report.details["tool_use"]["sub_scores"].items():
            lines.append(f"| {who} | {s['parse_rate']:.0%} | {s['function_choice']:.0%} | {s['arguments']:.0%} | {s['abstention']:.0%} |")
        lines += ["", "## Tool use by category", "",
                  "| category | n | baseline | quantized | diff | 90% CI | verdict | lost / gained | unparsable (base / quant) |",
                  "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
        for cat, c in report.details["tool_use"].get("by_category", {}).items():
            pf = c["parse_failures"]
            lines.append(f"| {cat} | {c['n']} | {c['baseline']:.1%} | {c['quantized']:.1%} | {c['diff']:+.1%} | "
                         f"[{c['ci'][0]:+.1%}, {c['ci'][1]:+.1%}] | {c['verdict']} | {c['lost']} / {c['gained']} | "
                         f"{pf['baseline']} / {pf['quantized']} |")
    if a := report.details.get("acceptance"):
        lines += ["", "## Speculative decoding: the draft's acceptance", "", f"Target {a['target']}, draft {a['draft']}; "
                  f"greedy α {a['alpha']['continuations']['greedy']:.3f} on the target's own greedy continuations (what the "
                  f"prediction uses), {a['alpha']['held_out']['greedy']:.3f} on held-out text, {a['alpha']['retrieval']['greedy']:.3f} on "
                  f"retrieval prompts (Σ min(p, q): {a['alpha']['held_out']['sampled']:.3f} / {a['alpha']['retrieval']['sampled']:.3f}); "
                  f"a draft step costs {a['cost']['draft_to_target']:.2f} target steps.", "",
                  "| k | predicted tokens per step | predicted speedup | verify step / decode step |", "| ---: | ---: | ---: | ---: |"]
        for p in a["predicted"]:
            lines.append(f"| {p['k']} | {p['tokens_per_step']:.2f} | {p['speedup']:.2f}x | {a['cost']['verify_to_decode'][p['k']]:.2f} |")
        m = a["measured"]
        lines += ["", f"Measured at k={m['k']} ({m['prompts']} prompts x {m['max_tokens']} tokens, greedy): "
                  f"{m['tokens_per_step']:.2f} tokens per verifying step (predicted {a['predicted'][m['k'] - 1]['tokens_per_step']:.2f}), "
                  f"speedup {m['speedup']:.2f}x."]
    lines += ["", f"Time per task (s): {report.timings_s}", ""]
    return "\n".join(lines)


def plots(report: EvalReport, out: Path) -> list[str]:
    """Retrieval accuracy against context length, and the KL histogram; needs matplotlib (optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    if "retrieval" in report.details:
        by = report.details["retrieval"]["by_length"]
        xs = [int(n) for n in by]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(xs, [by[n]["baseline"] for n in by], "o-", label="baseline")
        ax.plot(xs, [by[n]["quantized"] for n in by], "s--", label="quantized")
        ax.set(xlabel="context length (tokens)", ylabel="accuracy", ylim=(-0.05, 1.05), title="Retrieval")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "retrieval.png", dpi=120)
        plt.close(fig)
        made.append("retrieval.png")
    if "kl_histogram" in report.details:
        hist = report.details["kl_histogram"]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar([i * 0.05 for i in range(len(hist))], hist, width=0.05, align="edge")
        ax.set(xlabel="KL(baseline || quantized) per token (nats, clipped at 2)", ylabel="tokens", yscale="log", title="KL")
        fig.tight_layout()
        fig.savefig(out / "kl.png", dpi=120)
        plt.close(fig)
        made.append("kl.png")
    return made


def write(report: EvalReport, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    results = json.dumps(report.to_dict(), indent=1) + "\n"
    atomic_file(out / "results.json", lambda tmp: tmp.write_text(results))
    atomic_file(out / "report.md", lambda tmp: tmp.write_text(markdown(report)))
    return ["results.json", "report.md", *plots(report, out)]
