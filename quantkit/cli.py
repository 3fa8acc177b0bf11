"""The `quantkit` command line: each command parses its flags and calls the library.

Expected failures (QuantkitError, a full disk) print one line and exit 2; the traceback only with --debug.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import signal
import sys
import threading
from pathlib import Path

import typer
from rich.table import Table

# Typer may carry its own copy of click: find its usage-error base class through a public name.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

from quantkit import QuantkitError, __version__
from quantkit.ui import Reporter, human_bytes, stderr, stdout

app = typer.Typer(
    help="Quantize Hugging Face LLMs to INT4/INT8 compressed-tensors checkpoints, measure them, serve them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEBUG = typer.Option(False, "--debug", help="Show the full traceback on errors.")
JSON = typer.Option(False, "--json", help="Print a machine-readable JSON summary on stdout (no progress).")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress and no summary table.")


@app.command(
    epilog="Examples: quantkit quantize smollm2-135m --bits 4 -o smollm2-w4  |  "
    "quantkit quantize smollm2-135m --method gptq -g 64 --kv-cache fp8 -o smollm2-gptq  |  "
    "quantkit quantize smollm2-135m --budget kl=0.05 --method gptq -o smollm2-kl05",
)
def quantize(
    model: str = typer.Argument(..., help="Local HF directory, hub id (org/name), .gguf file, or smollm2-135m."),
    out: Path = typer.Option(..., "--out", "-o", help="Output checkpoint directory."),
    bits: int | None = typer.Option(None, "--bits", "-b", help="Weight bits: 4 or 8 (5 and 6: smaller than 8, vLLM runs them only on CUDA with Humming).  [default: 4]"),
    group_size: int | None = typer.Option(
        None, "--group-size", "-g", help="Columns per scale; -1 = per channel.  [default: 128 below 8 bits, per channel at 8]"
    ),
    asym: bool | None = typer.Option(None, "--asym/--sym", help="Asymmetric (zero points) or symmetric.  [default: sym]"),
    method: str | None = typer.Option(
        None, "--method", "-m", help="rtn, gptq, awq, none (weights dense), bnb-nf4 or bnb-int8.  [default: rtn]"
    ),
    kv_cache: str | None = typer.Option(None, "--kv-cache", help="fp8: calibrate static FP8 KV-cache scales."),
    kv_strategy: str | None = typer.Option(None, "--kv-strategy", help="KV scales per 'tensor' or per KV 'head'."),
    actorder: bool | None = typer.Option(None, "--actorder/--no-actorder", help="GPTQ: static activation order."),
    true_sequential: bool | None = typer.Option(
        None, "--true-sequential/--no-true-sequential",
        help="GPTQ: each sublayer's Hessian from the quantized ones before it, or all from the dense layer.  [default: true]"),
    budget: str | None = typer.Option(
        None, "--budget", help="Choose each layer's precision to meet kl=NATS (mean KL on held-out text, proven), "
        "bits=AVERAGE (bits per Linear weight) or size=BYTES (checkpoint, e.g. 800MB)."),
    choices: str | None = typer.Option(
        None, "--choices", help="With --budget: the precisions a unit may take, e.g. w4g128,w4g64,w8,dense.  "
        "[default: 4-bit at the model's group and half it, w8, dense]"),
    embeddings: str | None = typer.Option(
        None, "--embeddings", help="The vocabulary tables (embedding, head): dense, w8 (int8 per row: quantkit's runtime reads it; HF "
        "transformers reads an untied int8 head, not yet an int8 embedding), w8g32 (int8 with a scale per 32 values: "
        "6% more bytes, a fourteenth of the KL on SmolLM2), head (an untied head alone at int8: "
        "HF transformers reads it, vLLM's CPU build cannot; it halves what the head reads each decode step) or auto (with --budget: the budget "
        "decides).  [default: dense]"),
    heldout: str = typer.Option("builtin", "--heldout", help="With --budget kl=: the held-out text the KL is proven on."),
    calib: str = typer.Option("builtin", "--calib", help="Calibration text: builtin, a .txt/.jsonl/.parquet file, or a hub dataset."),
    calib_samples: int = typer.Option(128, "--calib-samples", help="Calibration rows."),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen", help="Tokens per calibration row."),
    calib_split: str = typer.Option("train", "--calib-split", help="Split of a hub dataset."),
    calib_column: str = typer.Option("text", "--calib-column", help="Text column of a dataset or JSONL file."),
    chat_template: bool = typer.Option(False, "--chat-template", help="Format 'messages' rows with the chat template."),
    seed: int = typer.Option(0, "--seed", help="Calibration sampling seed."),
    device: str = typer.Option("auto", "--device", help="Where each layer is quantized: cpu, cuda or auto."),
    recipe: list[str] = typer.Option([], "--recipe", "-r", help="Recipe YAML file or bundled name; repeat to compose."),
    ignore: list[str] = typer.Option([], "--ignore", help="Keep matching Linears dense: module name or 're:REGEX'."),
    dtype: str | None = typer.Option(None, "--dtype", help="Scale and dense-tensor dtype: bf16 or fp16.  [default: the model's]"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard."),
    force: bool = typer.Option(False, "--force", "-f", help="Replace OUT if it exists."),
    as_json: bool = JSON,
    quiet: bool = QUIET,
    debug: bool = DEBUG,
) -> None:
    """Quantize MODEL's decoder Linears and write a compressed-tensors checkpoint to OUT."""
    from quantkit.calib.data import CalibConfig
    from quantkit.config import build_recipe
    from quantkit.formats.save import parse_size
    from quantkit.quantize import run_quantize

    overrides = {"bits": bits, "group_size": group_size, "method": method, "dtype": dtype,
                 "symmetric": None if asym is None else not asym, "kv_cache": kv_cache, "kv_strategy": kv_strategy,
                 "actorder": None if actorder is None else ("static" if actorder else "none"),
                 "true_sequential": true_sequential, "embeddings": embeddings}
    spec = build_recipe(recipe, overrides, ignore)
    calib_cfg = CalibConfig(calib, calib_samples, calib_seqlen, seed, calib_split, calib_column, chat_template)
    if spec.embeddings == "auto" and budget is None:
        raise QuantkitError("--embeddings auto needs --budget (the budget decides); use dense, w8 or head without one")
    if spec.embeddings == "head" and budget is not None:
        raise QuantkitError("--embeddings head fixes the head without a budget; with --budget use auto (it decides each table) or w8")
    if spec.embeddings != "dense" and spec.method.startswith("bnb"):
        raise QuantkitError(f"--embeddings {spec.embeddings} writes compressed-tensors int8 tables; {spec.method} checkpoints "
                            "keep bitsandbytes' own layout (use --method rtn, gptq or awq)")
    if budget is not None or choices is not None:
        from quantkit.budget.plan import parse_budget
        from quantkit.budget.run import run_budgeted

        if budget is None:
            raise QuantkitError("--choices needs --budget (kl=, bits= or size=)")
        report = run_budgeted(model, out, spec, parse_budget(budget), choices, parse_size(max_shard_size), force,
                              Reporter(quiet or as_json), calib_cfg, device, heldout)
        if as_json:
            print(json.dumps(report.to_dict(), indent=2, default=vars))
        elif not quiet:
            _budget_table(report)
        return
    result = run_quantize(model, out, spec, parse_size(max_shard_size), force, Reporter(quiet or as_json), calib_cfg, device)
    if as_json:
        print(json.dumps(result.summary(), indent=2))
    elif not quiet:
        _quantize_table(result)


def _budget_table(report) -> None:
    table = Table(title=f"{report.quantize['out']}: budget {report.budget} ({report.method})", title_justify="left")
    for col in ("unit", *report.choices, "choice"):
        table.add_column(col, justify="left" if col in ("unit", "choice") else "right")
    for u in report.units:
        table.add_row(u["name"].removeprefix("model.layers."),
                      *(f"{u['sensitivity'][c]:.5f}" if c in u["sensitivity"] else "-" for c in report.choices), u["choice"])
    stdout.print(table)
    stdout.print("predicted mean KL added per unit, nats / token (one unit quantized at a time)")
    summary = Table(show_header=False)
    for i, r in enumerate(report.rounds):
        summary.add_row(f"round {i + 1}", f"{', '.join(f'{n} {c}' for c, n in sorted(r.counts.items()))}: predicted "
                        f"{r.predicted_kl:.4f}, measured {r.measured_kl:.4f}")
    summary.add_row("size", f"{human_bytes(report.checkpoint_bytes)} checkpoint; Linear weights {human_bytes(report.linear_bytes)}, "
                    f"{report.average_bits:.2f} bits a weight on average")
    summary.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in report.timings_s.items()))
    stdout.print(summary)


def _quantize_table(result) -> None:
    r = result.recipe
    group = "per channel" if r.group_size is None else f"group {r.group_size}"
    table = Table(title=f"{result.out}", show_header=False, title_justify="left")
    weights = f"{r.method} int{r.bits} {group} {'sym' if r.symmetric else 'asym'}, scales {r.dtype}" if r.scheme() else "dense"
    if r.method.startswith("bnb"):
        weights = "bitsandbytes NF4, blocks of 64" if r.method == "bnb-nf4" else "bitsandbytes LLM.int8"
    table.add_row("scheme", weights + (f"; KV cache fp8 per {r.kv_strategy}" if r.kv_cache else ""))
    if result.calibration:
        table.add_row("calibration", result.calibration)
    table.add_row("quantized Linears", str(result.quantized_modules))
    if result.expert_tokens:  # the calibration tokens each expert was routed, over the sparse layers
        counts = sorted(n for tokens in result.expert_tokens.values() for n in tokens)
        table.add_row("tokens per expert", f"min {counts[0]}, median {counts[len(counts) // 2]}, max {counts[-1]} "
                      f"({len(counts)} experts in {len(result.expert_tokens)} layers; per expert in quantkit.json)")
    table.add_row("size", f"{human_bytes(result.dense_bytes)} dense fp16 -> {human_bytes(result.out_bytes)} "
                  f"({result.dense_bytes / max(result.out_bytes, 1):.2f}x smaller)")
    table.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in result.timings_s.items()))
    table.add_row("peak memory", human_bytes(result.peak_rss_bytes))
    stdout.print(table)


@app.command(epilog="Example: quantkit inspect smollm2-w4 --json")
def inspect(
    path: str = typer.Argument(..., help="Checkpoint directory (or any MODEL quantkit resolves)."),
    as_json: bool = JSON,
    debug: bool = DEBUG,
) -> None:
    """Show a checkpoint's architecture, quantization scheme, KV-cache scheme, parameters and sizes."""
    from quantkit.formats.inspect import inspect_checkpoint
    from quantkit.models import resolve

    info = inspect_checkpoint(resolve(path).path)
    if as_json:
        print(json.dumps(info.to_dict(), indent=2))
        return
    head = Table(title=info.path, show_header=False, title_justify="left")
    head.add_row("architecture", f"{info.architecture} ({info.model_type}), {info.layers} layers, hidden {info.hidden_size}, "
                 f"{info.heads} heads / {info.kv_heads} KV heads, vocab {info.vocab_size}, {info.dtype}")
    for name, group in info.config_groups.items():
        w = group.get("weights") or {}
        size = "per channel" if w.get("strategy") == "channel" else f"group {w.get('group_size')}"
        targets = group.get("targets", [])
        head.add_row(f"quantization {name}", f"{w.get('type')}{w.get('num_bits')} {size} "
                     f"{'symmetric' if w.get('symmetric') else 'asymmetric'} on "
                     + (", ".join(targets) if len(targets) <= 3 else f"{len(targets)} modules named in config.json"))
    if not info.config_groups:
        head.add_row("quantization", "none (dense)")
    dense = info.kept_dense
    head.add_row("ignored (dense)", (", ".join(dense[:6]) + (f" and {len(dense) - 6} more" if len(dense) > 6 else "")) or "-")
    if info.mix:
        head.add_row("decoder Linears", ", ".join(f"{n} {label}" for label, n in sorted(info.mix.items()))
                     + f"; {info.linear_bits:.2f} bits a weight on average" + (f" ({info.method})" if info.method else ""))
    if any(v.startswith("int") for v in info.tables.values()):
        head.add_row("vocabulary tables", "; ".join(f"{m} {v}" for m, v in info.tables.items()) + (
            " (a quantized embedding: quantkit's runtime reads it; HF transformers does not yet, vLLM only untied, on GPU)"
            if info.tables.get("model.embed_tokens", "").startswith("int") else ""))
    kv = info.kv_cache_scheme
    head.add_row("KV cache", "model dtype" if not kv else f"{kv.get('type')}{kv.get('num_bits')} per {kv.get('strategy')}")
    head.add_row("parameters", f"{info.parameters / 1e6:.1f} M ({info.quantized_parameters / 1e6:.1f} M quantized)")
    head.add_row("on disk", f"{human_bytes(info.bytes_on_disk)} vs {human_bytes(info.dense_fp16_bytes)} dense fp16 "
                 f"({info.ratio:.2f}x smaller)")
    head.add_row("weight memory at load", human_bytes(info.weight_memory_bytes))
    stdout.print(head)
    mods = Table("module", "count", "shape", "storage", title="weights", title_justify="left")
    for row in info.modules:
        mods.add_row(row.name, str(row.count), "x".join(map(str, row.shape)), row.storage)
    stdout.print(mods)
    if info.per_layer:  # a mix: each layer's Linears
        names = list(info.per_layer[0])
        short = [n.rsplit(".", 1)[-1] for n in names]
        mix = Table("layer", *short, title="the mix, per layer", title_justify="left")
        for i, layer in enumerate(info.per_layer):
            mix.add_row(str(i), *(layer.get(n, "-") for n in names))
        stdout.print(mix)


@app.command(epilog="Examples: quantkit models  |  quantkit models --json")
def models(as_json: bool = JSON, debug: bool = DEBUG) -> None:
    """List the built-in models: installed or not, size, source, license, and the command that installs them."""
    from quantkit.builtin import BUILTINS
    from quantkit.models import builtin_status

    rows = [builtin_status(alias) for alias in BUILTINS]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("alias", "installed", "GGUF", "model", "license", title="built-in models (any command takes the alias as MODEL)",
                  title_justify="left")
    for r in rows:
        found = r["parts"]
        state = "[green]yes[/]" if r["installed"] else f"[yellow]no[/] ({found['found']}/{found['total']} parts)"
        size = human_bytes(r["gguf_bytes"]) if r["gguf_bytes"] else "-"
        table.add_row(r["alias"], state, size, r["model"], r["license"])
    stdout.print(table)
    for r in rows:
        stdout.print(f"[bold]{r['alias']}[/]: {r['description']}; from {r['source']}", highlight=False, soft_wrap=True)
        where = r["path"] or ("converted to a dense checkpoint on first use" if r["installed"] else f"install: {r['install']}")
        stdout.print(f"  {where}", highlight=False, soft_wrap=True)


TASKS_DEFAULT = "ppl,kl,retrieval,tool-use"  # (eval.runner.DEFAULT_TASKS)
MIN_RETRIEVAL_LENGTH = 128  # tokens: a retrieval prompt's instructions, needles and question are 60-150


@app.command(
    "eval",
    epilog="Examples: quantkit eval smollm2-w4 --tasks ppl,kl,retrieval --lengths 1k,2k --limit 5  ·  "
           "quantkit eval smollm2-w4 --endpoint http://127.0.0.1:8000/v1",
)
def eval_(
    checkpoint: str = typer.Argument(..., help="The quantized model (any MODEL quantkit resolves)."),
    baseline: str | None = typer.Option(None, "--baseline", help="Reference model.  [default: the source in quantkit.json]"),
    tasks: str = typer.Option(TASKS_DEFAULT, "--tasks", help="Comma-separated: ppl, kl, retrieval, tool-use, acceptance (as a speculative draft)."),
    lengths: str = typer.Option("1k,2k", "--lengths", help="Retrieval context lengths in tokens (1k = 1024)."),
    limit: int | None = typer.Option(None, "--limit", help="Items per task and length (rows for ppl/kl)."),
    margin: float = typer.Option(2.0, "--margin", help="Equivalence margin in accuracy points."),
    bfcl: str = typer.Option("", "--bfcl", help="Also run bfcl-eval's data: e.g. simple,multiple,parallel,parallel_multiple,irrelevance."),
    bfcl_limit: int | None = typer.Option(None, "--bfcl-limit", help="A seeded sample of N BFCL items in all, split evenly over the --bfcl categories (the bundled set is then left out)."),
    tool_file: Path | None = typer.Option(None, "--tool-file", help="A BFCL-format JSONL file instead of the bundled set."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated retrieval items."),
    text: str = typer.Option("builtin", "--text", help="Held-out text for ppl/kl: builtin, a .txt/.jsonl/.parquet file, or a datasets name."),
    text_split: str = typer.Option("test", "--text-split", help="Split of a datasets --text."),
    text_column: str = typer.Option("text", "--text-column", help="Text column of a JSONL/parquet/datasets --text."),
    backend: str = typer.Option("runtime", "--backend", help="How both models run here: runtime (quantkit's engine, what serve serves) or hf (HF transformers, the cross-check); endpoint: the quantized model at --endpoint URL."),
    dtype: str = typer.Option("bf16", "--dtype", help="Compute dtype of the local backends: bf16, fp16 or fp32."),
    endpoint: str | None = typer.Option(None, "--endpoint", help="OpenAI-compatible base URL serving CKPT, e.g. http://127.0.0.1:8000/v1."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer key for --endpoint."),
    served_model: str | None = typer.Option(None, "--served-model-name", help="Model name at --endpoint.  [default: the first in GET /models]"),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute the baseline instead of reusing cached results."),
    draft: str | None = typer.Option(None, "--draft", help="acceptance: this model drafts for CHECKPOINT.  [default: CHECKPOINT drafts for its baseline]"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="acceptance: drafts per step in the measured run."),
    out: Path = typer.Option(Path("eval-results"), "--out", help="Folder for results.json, report.md and plots."),
    as_json: bool = JSON,
    quiet: bool = QUIET,
    debug: bool = DEBUG,
) -> None:
    """Compare a quantized model with its baseline: perplexity, KL, long-context retrieval and tool use."""
    from quantkit import QuantkitError
    from quantkit.eval.report import ci_text, fmt, write
    from quantkit.eval.runner import TASKS, EvalConfig, baseline_of, run_eval
    from quantkit.models import resolve

    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
    if bad := [t for t in chosen if t not in TASKS]:
        raise QuantkitError(f"--tasks: unknown task {bad[0]!r} (known: {', '.join(TASKS)})")
    if backend not in ("hf", "runtime", "endpoint"):
        raise QuantkitError(f"--backend {backend}: use runtime, hf or endpoint")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise QuantkitError(f"--dtype {dtype}: use bf16, fp16 or fp32")
    if limit is not None and limit < 1:
        raise QuantkitError(f"--limit {limit}: give at least 1 item per task and length (or leave it out)")
    if bfcl_limit is not None and (bfcl_limit < 1 or not bfcl):
        raise QuantkitError("--bfcl-limit needs a positive N and --bfcl categories")
    if backend == "endpoint" or endpoint:
        if not endpoint:
            raise QuantkitError("--backend endpoint needs --endpoint URL (e.g. http://127.0.0.1:8000/v1)")
        if tasks == TASKS_DEFAULT:  # an endpoint returns no logits: the generation tasks are what it can run
            chosen = ("retrieval", "tool-use")
        elif {"ppl", "kl", "acceptance"} & set(chosen):
            raise QuantkitError("ppl, kl and acceptance need full logits, which an endpoint does not return: use --tasks retrieval,tool-use")
        backend = "runtime" if backend == "endpoint" else backend  # how the baseline runs here
    cfg = EvalConfig(tasks=chosen, lengths=_lengths(lengths), limit=limit, margin=margin / 100, seed=seed,
                     bfcl=tuple(c for c in bfcl.split(",") if c), tool_file=tool_file, text=text,
                     text_split=text_split, text_column=text_column, cache=not no_cache, backend=backend,
                     dtype=dtype, bfcl_limit=bfcl_limit, endpoint=endpoint, api_key=api_key, served_model=served_model)
    ui = Reporter(quiet or as_json)
    ckpt = resolve(checkpoint, status=ui.note, bar=ui.bar)
    if draft is not None:
        if "acceptance" not in chosen:
            raise QuantkitError("--draft is for --tasks acceptance")
        cfg.draft = resolve(draft, status=ui.note, bar=ui.bar).path
    if not 1 <= num_speculative_tokens <= 8:
        raise QuantkitError("--num-speculative-tokens: 1 to 8 for the acceptance task")
    cfg.draft_k = num_speculative_tokens
    base = resolve(baseline or baseline_of(ckpt.path), status=ui.note, bar=ui.bar) if (chosen != ("acceptance",) or draft is None) else ckpt
    report = run_eval(ckpt, base, cfg, ui)
    files = write(report, out)
    if as_json:
        print(json.dumps({"summary": report.summary, "details": {k: v for k, v in report.details.items() if k != "kl_histogram"},
                          "timings_s": report.timings_s, "out": str(out), "files": files}, indent=2))
        return
    if quiet:
        return
    table = Table("task", "baseline", "quantized", "diff", "90% CI", "verdict", "n", "note",
                  title=f"{checkpoint} vs {base.spec}", title_justify="left")
    colors = {"equivalent": "green", "degraded": "red", "improved": "green"}
    for r in report.summary:
        color = colors.get(r["verdict"], "yellow")
        table.add_row(r["task"], fmt(r, "baseline"), fmt(r, "quantized"), fmt(r, "diff"), ci_text(r),
                      f"[{color}]{r['verdict']}[/]", str(r["n"]), r["note"])
    if report.summary:
        stdout.print(table)
    if cats := report.details.get("tool_use", {}).get("by_category"):
        by = Table("category", "n", "baseline", "quantized", "diff", "90% CI", "verdict", "lost / gained", "unparsable",
                   title="tool use by category", title_justify="left")
        for cat, c in cats.items():
            pf = c["parse_failures"]
            by.add_row(cat, str(c["n"]), f"{c['baseline']:.1%}", f"{c['quantized']:.1%}", f"{c['diff']:+.1%}",
                       f"[{c['ci'][0]:+.1%}, {c['ci'][1]:+.1%}]", c["verdict"], f"{c['lost']} / {c['gained']}",
                       f"{pf['baseline']} / {pf['quantized']}")
        stdout.print(by)
    if a := report.details.get("acceptance"):
        acc = Table("k", "predicted tokens / step", "predicted speedup", "verify / decode step", title=(
            f"{Path(a['draft']).name} drafting for {Path(a['target']).name}: greedy α {a['alpha']['continuations']['greedy']:.3f} "
            f"on its continuations, {a['alpha']['held_out']['greedy']:.3f} held-out, "
            f"{a['alpha']['retrieval']['greedy']:.3f} retrieval; a draft step = {a['cost']['draft_to_target']:.2f} target steps"), title_justify="left")
        for p in a["predicted"]:
            acc.add_row(str(p["k"]), f"{p['tokens_per_step']:.2f}", f"{p['speedup']:.2f}x", f"{a['cost']['verify_to_decode'][p['k']]:.2f}")
        stdout.print(acc)
        m = a["measured"]
        stdout.print(f"measured at k={m['k']}: {m['tokens_per_step']:.2f} tokens per verifying step "
                     f"(predicted {a['predicted'][m['k'] - 1]['tokens_per_step']:.2f}), speedup {m['speedup']:.2f}x")
    if cached := report.details.get("baseline_cached"):
        stdout.print(f"baseline results reused from the cache: {', '.join(cached)} (--no-cache recomputes)")
    stdout.print(f"wrote {', '.join(files)} to {out}")


@app.command(
    "serve",
    context_settings={"allow_extra_args": True},
    epilog="Example: quantkit serve smollm2-w4 --port 8000  |  curl localhost:8000/v1/chat/completions "
    "-H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'  |  "
    "on vLLM, two GPUs: quantkit serve smollm2-w4 --engine vllm --tensor-parallel-size 2 -- --gpu-memory-utilization 0.8",
)
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="A checkpoint directory (quantkit or HF), hub id, or smollm2-135m."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; the default answers this machine only."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="QUANTKIT_API_KEY",
                                       help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="The model id clients send.  [default: the directory name]"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Sequences decoded together in one step."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="Tokens per step (prefill chunks + decodes)."),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Requests allowed to wait for a slot; more get 429 with Retry-After."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto (fp8 when the checkpoint has scales), fp8, bf16, fp16, fp32."),
    kv_cache_memory: float | None = typer.Option(None, "--kv-cache-memory", help="KV-cache size in GiB.  [default: max-num-seqs full contexts, at most 25% of free memory]"),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto, bf16, fp16, fp32."),
    kernel: str = typer.Option("auto", "--kernel", help="auto (triton on CUDA, packed on CPU), packed, dense, reference or triton."),
    drain_seconds: int = typer.Option(30, "--drain-seconds", help="On SIGINT/SIGTERM, let in-flight requests finish this long, then abort them."),
    lm_head: str = typer.Option("auto", "--lm-head", help="auto (the checkpoint's weights) or int8 (quantized per row at load: "
                                "faster decode, slightly different logits)."),
    activations: str = typer.Option("float", "--activations", help="float, or int8: int4 layers multiply activations quantised "
                                    "to int8 per group in decode steps (llama.cpp's arithmetic; faster on CPUs without AVX-512 "
                                    "BF16, slightly different outputs; float32 engines)."),
    speculative: str | None = typer.Option(None, "--speculative", help="Draft tokens checked in each decode step: ngram (prompt lookup)."),
    draft: str | None = typer.Option(None, "--draft", help="Draft tokens from this model (same tokenizer, smaller: e.g. the target's W4)."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="With --speculative: draft tokens per step (1-16)."),
    ngram_min: int = typer.Option(2, "--ngram-min", help="With --speculative ngram: shortest suffix looked up in the context."),
    ngram_max: int = typer.Option(4, "--ngram-max", help="With --speculative ngram: longest suffix looked up (tried first)."),
    speculative_max_batch: int = typer.Option(4, "--speculative-max-batch", help="With --speculative: no drafts when more sequences run."),
    engine: str = typer.Option("quantkit", "--engine", help="quantkit (this process) or vllm (vLLM's server on the same "
                               "checkpoint; arguments after -- go to vLLM as they are)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="With --engine vllm: GPUs a layer is split over."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", "-pp", help="With --engine vllm: stages the layers are split into."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="With --engine vllm: the longest sequence.  [default: the model's]"),
    vllm_bin: str | None = typer.Option(None, "--vllm", envvar="QUANTKIT_VLLM", help="With --engine vllm: vLLM's `vllm` "
                                        "executable (its own environment).  [default: `vllm` on PATH]"),
    debug: bool = DEBUG,
) -> None:
    """Serve a checkpoint with an OpenAI-compatible API (chat, completions, streaming, tools) on quantkit's engine,
    or on vLLM's with --engine vllm."""
    from quantkit import QuantkitError
    from quantkit.models import resolve
    from quantkit.runtime import EngineConfig
    from quantkit.server.api import ServerConfig
    from quantkit.server.run import serve as run

    if not 0 < port < 65536:
        raise QuantkitError(f"--port {port}: use 1-65535")
    if max_num_seqs < 1 or max_waiting < 0 or max_num_batched_tokens < 1:
        raise QuantkitError("--max-num-seqs and --max-num-batched-tokens must be >= 1, --max-waiting >= 0")
    if engine not in ("quantkit", "vllm"):
        raise QuantkitError(f"--engine {engine}: use quantkit or vllm")
    if engine == "quantkit" and (ctx.args or tensor_parallel_size != 1 or pipeline_parallel_size != 1 or max_model_len):
        raise QuantkitError("arguments after --, --tensor-parallel-size, --pipeline-parallel-size and --max-model-len "
                            "are for --engine vllm")
    if engine == "vllm" and (kernel != "auto" or lm_head != "auto" or activations != "float"):
        raise QuantkitError("--kernel, --lm-head and --activations choose quantkit's kernels; vLLM picks its own")
    ui = Reporter()
    path = resolve(model, status=ui.note, bar=ui.bar).path
    name = served_model_name or (model if not Path(model).exists() else Path(model).resolve().name)
    memory = None if kv_cache_memory is None else int(kv_cache_memory * 2**30)
    if engine == "vllm":
        from quantkit.server.vllm import VllmLaunch, caveat, find_vllm, run_vllm, vllm_args

        command = find_vllm(vllm_bin)  # vLLM missing: one line naming the install, before anything else
        if note := caveat(path):
            ui.note(note)
        if speculative not in (None, "ngram"):
            raise QuantkitError(f"--speculative {speculative}: use ngram")
        draft_path = str(resolve(draft, status=ui.note, bar=ui.bar).path) if draft else None
        launch = VllmLaunch(path, host, port, name, api_key, max_model_len, max_num_seqs, kv_cache_dtype, memory,
                            tensor_parallel_size, pipeline_parallel_size, draft_path,
                            (ngram_min, ngram_max) if speculative else None, num_speculative_tokens, list(ctx.args))
        _port_free(host, port)
        raise typer.Exit(run_vllm(command + vllm_args(launch), launch, ui.note))
    engine_cfg = EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory, kernel=kernel,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, lm_head=lm_head,
                              activations=activations, speculative=_speculative(speculative, draft, num_speculative_tokens, ngram_min, ngram_max, speculative_max_batch))
    _port_free(host, port)
    run(path, engine_cfg, ServerConfig(name, api_key, max_waiting), host, port, drain_seconds, announce=ui.note)


def _speculative(method: str | None, draft: str | None, k: int, n_min: int, n_max: int, max_batch: int):
    """The --speculative / --draft options as the engine's config (None: off); bad values are one clear error."""
    from quantkit import QuantkitError
    from quantkit.runtime.speculative import SpeculativeConfig

    if method is not None and draft is not None:
        raise QuantkitError("--speculative ngram and --draft MODEL are two kinds of drafts: give one")
    if draft is not None:
        return SpeculativeConfig("draft", k, n_min, n_max, max_batch, model=draft)
    return None if method is None else SpeculativeConfig(method, k, n_min, n_max, max_batch)


def _port_free(host: str, port: int) -> None:
    import socket

    from quantkit import QuantkitError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise QuantkitError(f"cannot listen on {host}:{port}: {e.strerror}") from None


@app.command(
    "bench",
    epilog="Examples: quantkit bench http://127.0.0.1:8000 --concurrency 8 --num-prompts 64 --output-len 128  |  "
    "quantkit bench http://127.0.0.1:8000 --sweep 1,4,16,64 --plot sweep.png  |  "
    "quantkit bench --offline smollm2-w4 --batch-sizes 1,8 --input-len 128 --output-len 64 --hf",
)
def bench(
    url: str | None = typer.Argument(None, help="An OpenAI-compatible server to load (arrives with quantkit serve)."),
    offline: str | None = typer.Option(None, "--offline", help="Benchmark quantkit's engine in-process on this model."),
    batch_sizes: str = typer.Option("1,8", "--batch-sizes", help="Comma-separated numbers of concurrent requests."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(64, "--output-len", help="Generated tokens per request (EOS ignored)."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto, bf16, fp16, fp32."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto, fp8, bf16, fp16, fp32."),
    kernel: str = typer.Option("auto", "--kernel", help="auto (triton on CUDA, packed on CPU), packed, dense, reference or triton."),
    lm_head: str = typer.Option("auto", "--lm-head", help="Offline: auto (the checkpoint's) or int8 (quantized per row at load)."),
    activations: str = typer.Option("float", "--activations", help="Offline: float, or int8 (int4 layers take int8-quantised activations in decode steps)."),
    repeats: int = typer.Option(3, "--repeats", help="Offline: runs per system and batch size; the table shows the median run."),
    speculative: str | None = typer.Option(None, "--speculative", help="Offline: draft tokens checked in each decode step: ngram (prompt lookup)."),
    draft: str | None = typer.Option(None, "--draft", help="Offline: draft tokens from this model (same tokenizer, smaller)."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="Offline, with --speculative: draft tokens per step (1-16)."),
    ngram_min: int = typer.Option(2, "--ngram-min", help="Offline, with --speculative ngram: shortest suffix looked up in the context."),
    ngram_max: int = typer.Option(4, "--ngram-max", help="Offline, with --speculative ngram: longest suffix looked up (tried first)."),
    speculative_max_batch: int = typer.Option(4, "--speculative-max-batch", help="Offline, with --speculative: no drafts when more sequences run."),
    hf: bool = typer.Option(False, "--hf", help="Also run HF transformers generate on the same workload."),
    llama_cpp: Path | None = typer.Option(None, "--llama-cpp", help="Also run this GGUF in llama.cpp (llama-cpp-python)."),
    model: str | None = typer.Option(None, "--model", help="URL mode: the model name to send.  [default: the first in GET /v1/models]"),
    concurrency: int | None = typer.Option(None, "--concurrency", "-c", help="URL mode: requests in flight at most.  [default: all]"),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="URL mode: requests per second, Poisson arrivals.  [default: inf]"),
    num_prompts: int = typer.Option(100, "--num-prompts", "-n", help="URL mode: requests per run (per level with --sweep)."),
    prompts_file: Path | None = typer.Option(None, "--prompts", help='URL mode: a JSONL file of {"prompt": ..., "output_len": ...} rows.'),
    sweep: str | None = typer.Option(None, "--sweep", help="URL mode: concurrency levels to run in turn, e.g. 1,4,16,64."),
    plot: Path | None = typer.Option(None, "--plot", help="URL mode: PNG of throughput vs latency.  [default with --sweep: bench-sweep.png]"),
    chat: bool = typer.Option(False, "--chat", help="URL mode: send chat completions instead of completions."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="URL mode: bearer token for the server."),
    tokenizer: str = typer.Option("smollm2-135m", "--tokenizer", help="URL mode: tokenizer that sizes the prompts (directory, hub id or alias)."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="URL mode: ask for exactly --output-len tokens."),
    seed: int = typer.Option(0, "--seed", help="URL mode: seed of the random prompts and arrivals."),
    as_json: bool = JSON,
    quiet: bool = QUIET,
    debug: bool = DEBUG,
) -> None:
    """Measure generation throughput and latency: an OpenAI-compatible server under load (URL), or quantkit's
    engine in-process (--offline) side by side with HF and llama.cpp."""
    from quantkit import QuantkitError
    from quantkit.bench.loadgen import LoadConfig
    from quantkit.bench.offline import (
        Workload,
        kv_tokens_per_gib,
        median_run,
        prompts_for,
        run_engine,
        run_hf,
        run_llama_cpp,
    )
    from quantkit.models import resolve
    from quantkit.runtime import EngineConfig, LLMEngine
    from quantkit.runtime.speculative import acceptance

    if offline is not None and url is not None:
        raise QuantkitError("give a server URL or --offline MODEL, not both")
    if offline is None and url is None:
        raise QuantkitError("give a server URL (quantkit bench http://127.0.0.1:8000) or --offline MODEL")
    if offline is None:
        cfg = LoadConfig(url, model, concurrency, request_rate, num_prompts, input_len, output_len, prompts_file, chat,
                         ignore_eos, api_key, seed)
        _bench_url(cfg, sweep, plot, tokenizer, as_json, quiet)
        return
    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise QuantkitError(f"--batch-sizes: {batch_sizes!r} is not a list of integers like 1,8") from None
    if not sizes or min(sizes) < 1 or input_len < 1 or output_len < 2:
        raise QuantkitError("--batch-sizes, --input-len must be >= 1 and --output-len >= 2")
    ui = Reporter(quiet or as_json)
    path = resolve(offline, status=ui.note, bar=ui.bar).path
    results, kv, accepted = [], {}, {}
    spec = _speculative(speculative, draft, num_speculative_tokens, ngram_min, ngram_max, speculative_max_batch)
    if repeats < 1:
        raise QuantkitError("--repeats must be >= 1")
    for b in sizes:
        w = Workload(b, input_len, output_len)
        engine = LLMEngine(path, EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kernel=kernel, max_num_seqs=b,
                                              max_num_batched_tokens=max(2048, input_len), lm_head=lm_head,
                                              activations=activations, speculative=spec))
        if input_len + output_len > engine.max_len:
            raise QuantkitError(f"--input-len {input_len} plus --output-len {output_len} exceed the {engine.max_len} tokens "
                                "a sequence may reach here (the model's context, or the KV cache)")
        ui.note(engine.describe())
        engine.warm_up()
        load = {k: round(v, 3) for k, v in engine.timings.items()}
        ui.note(f"loaded in {sum(engine.timings.values()):.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in load.items()) + ")")
        runs: dict[str, list] = {}
        for rep in range(repeats):
            prompts = prompts_for(engine.tokenizer, dataclasses.replace(w, seed=w.seed + rep))  # the same ids for every system
            with ui.step(f"quantkit engine, batch {b}, run {rep + 1}/{repeats}"):
                runs.setdefault("quantkit", []).append(run_engine(engine, w, prompts))
            if hf:
                with ui.step(f"HF generate, batch {b}, run {rep + 1}/{repeats}"):
                    runs.setdefault("hf", []).append(run_hf(path, w, prompts, engine.dtype, engine.tokenizer))
            if llama_cpp:
                with ui.step(f"llama.cpp, batch {b} (one request at a time), run {rep + 1}/{repeats}"):
                    runs.setdefault("llama.cpp", []).append(run_llama_cpp(llama_cpp, w, prompts, torch_threads()))
        results += [median_run(r) for r in runs.values()]
        kv = kv_tokens_per_gib(engine)
        if spec is not None:
            accepted[b] = acceptance(engine.spec_stats)  # over all of this batch size's runs
    if as_json:
        print(json.dumps({"model": offline, "repeats": repeats, "load_s": load, "kv_tokens_per_gib": kv,
                          "results": [r.to_dict() for r in results], "speculative": accepted or None}, indent=2))
        return
    if quiet:
        return
    table = Table("system", "batch", "in", "out", "time", "TTFT", "prefill tok/s", "output tok/s", "decode tok/s", "vs quantkit",
                  title=f"{offline}: offline generation", title_justify="left")
    ours = {r.batch: r for r in results if r.system == "quantkit"}
    for r in results:
        ratio = r.output_tok_s / ours[r.batch].output_tok_s
        table.add_row(r.system, str(r.batch), str(r.input_len), str(r.output_len), f"{r.seconds:.2f} s", f"{r.ttft_s * 1e3:.0f} ms",
                      f"{r.prefill_tok_s:.0f}", f"{r.output_tok_s:.1f}", f"{r.decode_tok_s:.1f}", f"{ratio:.2f}x")
    stdout.print(table)
    stdout.print(f"KV cache tokens per GiB: {kv['fp16']:,} at fp16, {kv['fp8']:,} at FP8")
    for b, a in accepted.items():
        stdout.print(f"speculative ({spec.method}, k={spec.num_tokens}), batch {b}: acceptance rate {a['acceptance_rate']:.2f}, "
                     f"{a['mean_acceptance_length']:.2f} tokens per verifying step, {a['drafts']:,} verifying steps")


def _bench_url(cfg, sweep: str | None, plot: Path | None, tokenizer: str, as_json: bool, quiet: bool) -> None:
    import asyncio

    from quantkit import QuantkitError
    from quantkit.bench.loadgen import (
        base_url,
        file_prompts,
        plot_sweep,
        random_prompts,
        run_load,
    )
    from quantkit.models import load_tokenizer, resolve

    base_url(cfg.url)
    try:
        levels = [int(c) for c in sweep.split(",") if c.strip()] if sweep else [cfg.concurrency]
    except ValueError:
        raise QuantkitError(f"--sweep: {sweep!r} is not a list of integers like 1,4,16,64") from None
    if any(c is not None and c < 1 for c in levels) or cfg.num_prompts < 1 or cfg.input_len < 1 or cfg.output_len < 1:
        raise QuantkitError("--concurrency, --sweep levels, --num-prompts, --input-len and --output-len must be >= 1")
    if not cfg.request_rate > 0:
        raise QuantkitError("--request-rate must be > 0 (inf: all at once)")
    ui = Reporter(quiet or as_json)
    tok = load_tokenizer(resolve(tokenizer, status=ui.note).path)
    if cfg.prompts_file:
        rows = file_prompts(cfg.prompts_file, tok)
        prompts = [(text, n, out or cfg.output_len) for text, n, out in rows]
        prompts = [prompts[i % len(prompts)] for i in range(cfg.num_prompts)]
    else:
        prompts = [(text, n, cfg.output_len) for text, n in random_prompts(tok, cfg.num_prompts, cfg.input_len, cfg.seed)]
    summaries = []
    for level in levels:
        run_cfg = dataclasses.replace(cfg, concurrency=level)
        with ui.bar(f"concurrency {level or 'unbounded'}: {cfg.num_prompts} requests", cfg.num_prompts) as advance:
            summaries.append(asyncio.run(run_load(run_cfg, prompts, advance)))
    if plot is None and sweep:
        plot = Path("bench-sweep.png")
    if plot is not None:
        plot_sweep(summaries, plot, f"{cfg.url}: {cfg.input_len} in / {cfg.output_len} out")
    if as_json:
        print(json.dumps({"url": cfg.url, "input_len": cfg.input_len, "output_len": cfg.output_len,
                          "plot": None if plot is None else str(plot), "runs": [s.to_dict() for s in summaries]}, indent=2))
        return
    if quiet:
        return
    table = Table("concurrency", "ok", "failed", "req/s", "output tok/s", "TTFT mean / p50 / p99 ms", "TPOT mean / p50 / p99 ms",
                  "ITL mean / p50 / p99 ms", "E2E mean ms", title=f"{cfg.url}: {len(prompts)} requests per level", title_justify="left")
    fmt = lambda d: f"{d['mean']:.0f} / {d['p50']:.0f} / {d['p99']:.0f}"
    for s in summaries:
        table.add_row(str(s.concurrency or "all"), str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
                      f"{s.output_throughput:.1f}", fmt(s.ttft_ms), fmt(s.tpot_ms), fmt(s.itl_ms), f"{s.e2el_ms['mean']:.0f}")
    stdout.print(table)
    for s in summaries:
        for e in s.errors:
            stderr.print(f"[yellow]failed request (concurrency {s.concurrency}):[/] {e}", highlight=False)
    if plot is not None:
        stdout.print(f"plot: {plot}")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _lengths(text: str) -> tuple[int, ...]:
    from quantkit import QuantkitError

    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError:
            raise QuantkitError(f"--lengths: {part!r} is not a length like 1k, 2k or 4096") from None
        if out[-1] < MIN_RETRIEVAL_LENGTH:
            raise QuantkitError(f"--lengths: {part!r} is shorter than the {MIN_RETRIEVAL_LENGTH} tokens a retrieval "
                                "item needs (its instructions, needles and question, and filler to hide them in)")
    return tuple(out)


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        print(f"quantkit {__version__}")
        raise typer.Exit()


_TERMINATED: list[int] = []  # the SIGTERM that interrupted this command, if one did


def _terminate(signum, frame) -> None:
    """SIGTERM (a job scheduler, `kill`, a container stopping) raised like Ctrl-C, so that the same cleanup runs: a
    budget's candidate mixes and kept baseline logits (5 GB on a 1.5B model) and half-written outputs are removed,
    where the default action would end the process with them left on disk."""
    _TERMINATED.append(signum)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning expected failures into one line and exit status 2."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    on_main = threading.current_thread() is threading.main_thread()  # (signal handlers can only be set there)
    _TERMINATED.clear()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    try:
        _run(args, debug)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _run(args: list[str], debug: bool) -> None:
    try:
        code = typer.main.get_command(app).main(args=args, prog_name="quantkit", standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _interrupted()
    except ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()
            sys.exit(2)
        _fail(e.format_message().splitlines()[0] + " (see --help)", 2)
    except QuantkitError as e:
        _raise_or_fail(debug, str(e), 2)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            _raise_or_fail(debug, f"no space left on device ({e.filename or 'writing output'})", 2)
        _raise_or_fail(debug, f"{e.strerror or e}: {e.filename}" if e.filename else str(e), 2)
    except KeyboardInterrupt:
        _interrupted()
    except Exception as e:  # a bug: still one line, with the way to the traceback
        _raise_or_fail(debug, f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", 1)
    if code == 130:  # typer's answer to a KeyboardInterrupt: a silent exit status
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)


def _interrupted() -> None:
    if _TERMINATED:
        _fail("terminated", 128 + _TERMINATED.pop())
    _fail("interrupted", 130)


def _raise_or_fail(debug: bool, msg: str, code: int) -> None:
    if debug:
        stderr.print_exception()
    _fail(msg, code)


def _fail(msg: str, code: int) -> None:
    stderr.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    sys.exit(code)
