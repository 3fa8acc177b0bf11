"""`quantkit eval`: the quantized model against its baseline, task by task, with paired verdicts.

Tasks: `ppl` and `kl` (one pass over held-out text gives both), `retrieval` (generated long-context
items), `tool-use` (BFCL-schema items), `acceptance` (how good a draft for speculative decoding one model
makes for the other: predicted and measured). Every item's raw output, parsed answer and correctness is kept
for both models, so any number in the report can be traced to the items behind it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit import QuantkitError
from quantkit.calib.data import BUILTIN, builtin_texts, eval_rows
from quantkit.eval import retrieval, tool_use
from quantkit.eval.cache import ResultCache, digest_of, key
from quantkit.eval.kl import distribution
from quantkit.eval.stats import DEGRADED, EQUIVALENT, compare
from quantkit.ui import Reporter

TASKS = ("ppl", "kl", "retrieval", "tool-use", "acceptance")
DEFAULT_TASKS = TASKS[:4]  # acceptance (a speculative draft's) is asked for by name
RETRIEVAL_TASKS = ("passkey", "niah_number", "niah_word", "niah_uuid", "niah_multikey", "niah_multivalue",
                   "niah_multiquery", "variable_tracking", "json_kv")
# Distribution verdict thresholds (nats per token, and perplexity ratio).
KL_EQUIVALENT, KL_DEGRADED = 0.02, 0.10
PPL_EQUIVALENT, PPL_DEGRADED = 1.02, 1.10
TOOL_FLOOR = 0.2  # a baseline scoring under this cannot tell the models apart on tool use
# Tokens a retrieval answer may take: an instruction-tuned model words a 36-character UUID as a sentence ("The special
# magic uuid for X mentioned in the provided text is ..."), and a limit of 48 cut such answers a few characters short
# (docs/benchmarks.md, the 1.5B at 4k and 8k). RULER gives its needle tasks 128.
RETRIEVAL_ANSWER_TOKENS = 128


@dataclass(slots=True)
class EvalConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (1024, 2048)
    limit: int | None = None  # items per task and length (retrieval), rows (ppl/kl), items (tool use)
    margin: float = 0.02
    seed: int = 0
    seqlen: int = 512  # held-out rows for ppl/kl
    bfcl: tuple[str, ...] = ()
    tool_file: Path | None = None
    retrieval_tasks: tuple[str, ...] = RETRIEVAL_TASKS
    text: str = BUILTIN  # held-out text for ppl/kl: "builtin", a local file, or a datasets name
    text_split: str = "test"
    text_column: str = "text"
    cache: bool = True  # reuse baseline results from earlier runs
    backend: str = "runtime"  # how both models run locally: "runtime" (quantkit's engine) or "hf" (transformers)
    dtype: str = "bf16"  # compute dtype of the local backends
    bfcl_limit: int | None = None  # a seeded sample of this many BFCL items, stratified over the categories
    endpoint: str | None = None
    api_key: str | None = None
    served_model: str | None = None
    draft: Path | None = None  # acceptance: the draft (the checkpoint is then the target); default: the checkpoint drafts for its baseline
    draft_k: int = 4  # acceptance: drafts per step in the measured run


@dataclass(slots=True)
class EvalReport:
    checkpoint: str
    baseline: str
    config: dict
    summary: list[dict] = field(default_factory=list)  # one row per task: accuracies, diff, CI, verdict
    details: dict[str, Any] = field(default_factory=dict)
    items: list[dict] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "baseline": self.baseline, "config": self.config, "summary": self.summary,
                "details": self.details, "timings_s": self.timings_s, "items": self.items}


def baseline_of(ckpt: Path) -> str:
    manifest = ckpt / "quantkit.json"
    if not manifest.exists():
        raise QuantkitError(f"{ckpt} has no quantkit.json recording its source model: pass --baseline MODEL")
    return json.loads(manifest.read_text())["source"]["model"]


def distribution_verdict(kl_mean: float, ppl_ratio: float) -> str:
    if kl_mean <= KL_EQUIVALENT and ppl_ratio <= PPL_EQUIVALENT:
        return EQUIVALENT
    if kl_mean > KL_DEGRADED or ppl_ratio > PPL_DEGRADED:
        return DEGRADED
    return "small loss"


def run_distribution(base, quant, cfg: EvalConfig, report: EvalReport, ui: Reporter, cache: ResultCache) -> None:
    """Both models run here, cache or not: exact KL needs both full next-token distributions, and a
    baseline's full logits (vocab floats per token) are too large to keep; this is the cheap task."""
    rows = eval_rows(base.tokenizer, cfg.seqlen, cfg.limit or 16, cfg.text, cfg.text_split, cfg.text_column)
    with ui.bar("ppl + KL (held-out rows)", rows.shape[0]) as advance:
        d = distribution(base, quant, rows, on_row=advance)
    verdict = distribution_verdict(d.kl_mean, d.ppl_ratio)
    report.details["distribution"] = d.to_dict()
    report.details["kl_histogram"] = torch.histc(d.kl_per_token.clamp(max=2.0), bins=40, min=0, max=2.0).tolist()
    report.summary.append({"task": "ppl", "baseline": d.ppl_baseline, "quantized": d.ppl_quantized,
                           "diff": d.ppl_ratio - 1, "ci": None, "verdict": verdict, "n": int(rows.shape[0]),
                           "note": f"ratio {d.ppl_ratio:.4f}"})
    report.summary.append({"task": "kl", "baseline": 0.0, "quantized": d.kl_mean, "diff": d.kl_mean, "ci": None,
                           "verdict": verdict, "n": d.tokens,
                           "note": f"median {d.kl_median:.4f}, p99 {d.kl_p99:.4f}, top-1 agreement {d.top1_agreement:.1%}"})
    if (budget := _kl_budget(quant.path)) is not None:  # a checkpoint quantized to a KL budget: was it kept?
        kept = d.kl_mean <= budget
        report.summary.append({"task": "budget", "baseline": budget, "quantized": d.kl_mean, "diff": d.kl_mean - budget,
                               "ci": None, "verdict": "met" if kept else "over budget", "n": d.tokens,
                               "note": f"kl={budget:g}, as quantized"
                                       + ("" if cfg.text == BUILTIN and not cfg.limit else " (other held-out rows than it was proven on)")})


def _kl_budget(path: Path) -> float | None:
    """The `--budget kl=` a checkpoint was quantized to, from its quantkit.json."""
    try:
        budget = json.loads((Path(path) / "quantkit.json").read_text()).get("budget") or {}
    except (OSError, ValueError):
        return None
    text = str(budget.get("budget", ""))
    return float(text.removeprefix("kl=")) if text.startswith("kl=") else None


def _run_pair(base, quant, prompts: list[str], max_new: int, label: str, ui: Reporter,
              cache: ResultCache) -> tuple[list[str], list[str]]:
    """Both models' greedy outputs for prompts; the baseline's come from the cache when it has them."""
    k = key(**base.identity, task=label, prompts=digest_of(prompts), max_new=max_new)
    out_b = cache.get(k, label)
    if out_b is None:
        with ui.bar(f"{label}: {base.name}", len(prompts)) as advance:
            out_b = base.generate(prompts, max_new, on_item=advance)
        cache.put(k, out_b)
    with ui.bar(f"{label}: {quant.name}", len(prompts)) as advance:
        out_q = quant.generate(prompts, max_new, on_item=advance)
    return out_b, out_q


def run_retrieval(base, quant, cfg: EvalConfig, report: EvalReport, ui: Reporter, cache: ResultCache) -> None:
    lengths = [n for n in cfg.lengths if n + 64 <= min(base.context_length, quant.context_length)]
    if not lengths:
        raise QuantkitError(f"no requested length fits the model's context of {base.context_length} tokens")
    filler = retrieval.Filler(builtin_texts("eval"))
    items = retrieval.generate(list(cfg.retrieval_tasks), lengths, cfg.limit or 3, cfg.seed, base.count, filler)
    prompts = [base.chat_prompt([{"role": "user", "content": it.prompt}]) for it in items]
    out_b, out_q = _run_pair(base, quant, prompts, RETRIEVAL_ANSWER_TOKENS, "retrieval", ui, cache)
    sb = torch.tensor([retrieval.score(o, it.answers) for o, it in zip(out_b, items)])
    sq = torch.tensor([retrieval.score(o, it.answers) for o, it in zip(out_q, items)])
    cb, cq = (sb == 1).float(), (sq == 1).float()
    paired = compare(cb, cq, cfg.margin)
    by_length = {n: {"baseline": cb[[i for i, it in enumerate(items) if it.length == n]].mean().item(),
                     "quantized": cq[[i for i, it in enumerate(items) if it.length == n]].mean().item()} for n in lengths}
    by_task = {t: {"baseline": cb[[i for i, it in enumerate(items) if it.task == t]].mean().item(),
                   "quantized": cq[[i for i, it in enumerate(items) if it.task == t]].mean().item()} for t in cfg.retrieval_tasks}
    report.details["retrieval"] = {"paired": paired.to_dict(), "by_length": by_length, "by_task": by_task}
    report.summary.append(_row("retrieval", paired))
    for it, ob, oq, b, q in zip(items, out_b, out_q, cb, cq):
        report.items.append({"task": "retrieval", "id": it.id, "subtask": it.task, "length": it.length, "tokens": it.tokens,
                             "depth": it.depth, "answers": it.answers, "baseline": {"output": ob, "correct": bool(b)},
                             "quantized": {"output": oq, "correct": bool(q)}})


def tool_items(cfg: EvalConfig) -> list[tool_use.ToolItem]:
    """The bundled set (or --tool-file), then each --bfcl category; --limit applies to each source. With
    --bfcl-limit N the BFCL items are a seeded sample of N, split evenly over the categories (all of a
    category smaller than its share), and the bundled set is left out unless --tool-file names one."""
    bfcl = [bfcl_items(c) for c in cfg.bfcl]
    if cfg.bfcl_limit:
        own = [tool_use.load_items(cfg.tool_file)] if cfg.tool_file else []
        return [it for items in own for it in (items[: cfg.limit] if cfg.limit else items)] + stratified(bfcl, cfg.bfcl_limit, cfg.seed)
    sources = [tool_use.load_items(cfg.tool_file or tool_use.bundled_path())] + bfcl
    return [it for items in sources for it in (items[: cfg.limit] if cfg.limit else items)]


def stratified(groups: list[list], n: int, seed: int) -> list:
    """n items drawn without replacement, as evenly over the groups as their sizes allow, each group's
    draw kept in its file order; the same seed gives the same items."""
    import random

    rng = random.Random(seed)
    share, left = [0] * len(groups), n
    while left > 0 and any(share[i] < len(g) for i, g in enumerate(groups)):
        for i, g in enumerate(groups):
            if left > 0 and share[i] < len(g):
                share[i] += 1
                left -= 1
    return [g[j] for g, k in zip(groups, share) for j in sorted(rng.sample(range(len(g)), k))]


def bfcl_items(category: str) -> list[tool_use.ToolItem]:
    import importlib.util

    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None:
        raise QuantkitError("--bfcl needs the bfcl-eval package: pip install --no-deps bfcl-eval")
    root = Path(spec.origin).parent / "data"
    name = "simple_python" if category == "simple" else category
    path = root / f"BFCL_v4_{name}.json"
    if not path.exists():
        raise QuantkitError(f"no BFCL category {category!r} in {root}")
    return tool_use.load_items(path, category, root / "possible_answer" / path.name)


def run_tool_use(base, quant, cfg: EvalConfig, report: EvalReport, ui: Reporter, cache: ResultCache) -> None:
    items = tool_items(cfg)
    prompts = []
    for it in items:
        messages, tools = tool_use.messages_for(it, base.supports_tools)
        prompts.append(base.chat_prompt(messages, tools))
    out_b, out_q = _run_pair(base, quant, prompts, 160, "tool use", ui, cache)
    scored = {"baseline": [], "quantized": []}
    for it, ob, oq in zip(items, out_b, out_q):
        row = {"task": "tool-use", "id": it.id, "category": it.category}
        for who, out in (("baseline", ob), ("quantized", oq)):
            s, calls = tool_use.score_item(it, out)
            scored[who].append(s)
            row[who] = {"output": out, "calls": calls, "parsed": s.parsed, "correct": s.correct, "error": s.error}
        report.items.append(row)
    cb = torch.tensor([float(s.correct) for s in scored["baseline"]])
    cq = torch.tensor([float(s.correct) for s in scored["quantized"]])
    paired = compare(cb, cq, cfg.margin, floor=TOOL_FLOOR)
    sub = {who: _tool_sub_scores(ss, items) for who, ss in scored.items()}
    by_category = {}
    for cat in dict.fromkeys(it.category for it in items):
        idx = [i for i, it in enumerate(items) if it.category == cat]
        p = compare(cb[idx], cq[idx], cfg.margin, floor=TOOL_FLOOR)
        by_category[cat] = {"n": len(idx), "baseline": p.baseline, "quantized": p.quantized, "diff": p.diff,
                            "ci": [p.ci_low, p.ci_high], "verdict": p.verdict, "lost": p.flips_lost, "gained": p.flips_gained,
                            "parse_failures": {who: sum(not scored[who][i].parsed for i in idx) for who in scored}}
    report.details["tool_use"] = {"paired": paired.to_dict(), "sub_scores": sub, "by_category": by_category,
                                  "native_tools": base.supports_tools}
    row = _row("tool-use", paired)
    fails = {who: sum(not s.parsed for s in ss) for who, ss in scored.items()}
    if any(fails.values()):
        row["note"] += f"; unparsable calls: baseline {fails['baseline']}, quantized {fails['quantized']}"
    report.summary.append(row)


def _tool_sub_scores(ss: list, items: list) -> dict:
    """Where the points went: calls that do not parse (counted apart from wrong calls), the right functions,
    the right arguments, and abstaining when no function applies."""
    relevant = [s for s, it in zip(ss, items) if it.category != "irrelevance"]
    abstain = [s for s, it in zip(ss, items) if it.category == "irrelevance"]
    return {"parse_rate": sum(s.parsed for s in ss) / len(ss), "parse_failures": sum(not s.parsed for s in ss),
            "function_choice": sum(s.right_functions for s in relevant) / max(len(relevant), 1),
            "arguments": sum(s.correct for s in relevant) / max(len(relevant), 1),
            "abstention": sum(s.correct for s in abstain) / max(len(abstain), 1)}


def _row(task: str, p) -> dict:
    return {"task": task, "baseline": p.baseline, "quantized": p.quantized, "diff": p.diff, "ci": [p.ci_low, p.ci_high],
            "verdict": p.verdict, "n": p.n, "note": p.note or f"McNemar p={p.p_mcnemar:.3g}, lost {p.flips_lost}, gained {p.flips_gained}"}


def run_acceptance(base, quant, cfg: EvalConfig, report: EvalReport, ui: Reporter, cache: ResultCache) -> None:
    """How well the draft's tokens would survive the target's checks (eval/acceptance.py): α on held-out text, on
    retrieval prompts and on the target's own greedy continuations, the tokens per step and speedup that last
    one predicts for k = 1..8, and a measured run at k on the same prompts."""
    from quantkit.eval import acceptance as acc
    from quantkit.eval.backends import RuntimeBackend

    if cfg.draft is not None:
        target, draft = quant, RuntimeBackend(cfg.draft, "draft", dtype=cfg.dtype)
    else:
        target, draft = base, quant
    rows = list(eval_rows(target.tokenizer, cfg.seqlen, cfg.limit or 16, cfg.text, cfg.text_split, cfg.text_column).split(1))
    with ui.step("acceptance: retrieval prompts"):
        items = retrieval.generate(["passkey", "niah_multikey", "variable_tracking", "json_kv"], [1024], 1, cfg.seed, target.count,
                                   retrieval.Filler(builtin_texts("eval")))
        prompts = [torch.tensor([target.tokenizer(target.chat_prompt([{"role": "user", "content": it.prompt}]),
                                                  add_special_tokens=False)["input_ids"]]) for it in items]
    starts = [r[0, :128].tolist() for r in rows[:4]]
    with ui.step(f"acceptance: the target's greedy continuations of {len(starts)} held-out prompts"):
        own = [torch.tensor([p + c[:-1]]) for p, c in zip(starts, acc.continuations(target.engine, starts, 64))]
    with ui.bar("acceptance: both models on held-out text, retrieval prompts, continuations", len(rows) + len(prompts) + len(own)) as advance:
        text, retr = acc.alpha(target, draft, rows, on_row=advance), acc.alpha(target, draft, prompts, on_row=advance)
        cont = acc.alpha(target, draft, own, [len(p) - 1 for p in starts], on_row=advance)
    with ui.step("acceptance: timing both models' decode steps"):
        steps = {n: acc.decode_seconds(target.engine, n) for n in range(1, max(acc.KS) + 2)}
        draft_step = acc.decode_seconds(draft.engine, 1)
    with ui.step(f"acceptance: decoding the {len(starts)} prompts one at a time, with the draft (k={cfg.draft_k}) and without"):
        run = acc.measured(target.engine, draft.path, starts, cfg.draft_k)
    predicted = acc.predict(cont.greedy, draft_step, steps)
    report.details["acceptance"] = {
        "target": str(target.path), "draft": str(draft.path),
        "alpha": {name: {"greedy": a.greedy, "sampled": a.sampled, "tokens": a.tokens}
                  for name, a in (("held_out", text), ("retrieval", retr), ("continuations", cont))},
        "cost": {"draft_step_s": draft_step, "target_step_s": steps[1], "draft_to_target": draft_step / steps[1],
                 "verify_to_decode": {k: steps[k + 1] / steps[1] for k in acc.KS}},
        "predicted": predicted, "measured": run,
        "prediction_error": predicted[cfg.draft_k - 1]["tokens_per_step"] / run["tokens_per_step"] - 1 if run["tokens_per_step"] else None}


def run_eval(ckpt, baseline, cfg: EvalConfig, ui: Reporter) -> EvalReport:
    """ckpt/baseline: resolved models (objects with .path and .spec)."""
    from quantkit.eval.backends import EndpointBackend, HFBackend, RuntimeBackend

    fields = {k: v for k, v in _fields(cfg).items() if k != "api_key"}
    report = EvalReport(str(ckpt.spec), str(baseline.spec), {k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                                                             for k, v in fields.items()})
    cache = ResultCache(enabled=cfg.cache)
    def local(path: Path, name: str):
        if cfg.backend == "hf":
            from quantkit.models import DTYPES

            return HFBackend(path, name, dtype=DTYPES[cfg.dtype])
        return RuntimeBackend(path, name, dtype=cfg.dtype)

    with ui.step("reading both models' tokenizers"):
        base = local(baseline.path, "baseline")
        if cfg.endpoint:
            quant = EndpointBackend(cfg.endpoint, ckpt.path, "quantized", cfg.served_model, cfg.api_key)
        else:
            quant = local(ckpt.path, "quantized")
        _same_vocabulary(base, quant)
    steps = [("distribution", ("ppl" in cfg.tasks or "kl" in cfg.tasks), run_distribution),
             ("retrieval", "retrieval" in cfg.tasks, run_retrieval), ("tool-use", "tool-use" in cfg.tasks, run_tool_use),
             ("acceptance", "acceptance" in cfg.tasks, run_acceptance)]
    for name, wanted, fn in steps:
        if wanted:
            start = time.perf_counter()
            fn(base, quant, cfg, report, ui, cache)
            report.timings_s[name] = round(time.perf_counter() - start, 2)
    report.details["baseline_cached"] = cache.hits
    return report


def _same_vocabulary(base, quant) -> None:
    """Every task compares the two models token by token on the baseline's token ids: models with different
    vocabularies are one line here, not an index error halfway through the first task."""
    a, b = base.tokenizer, quant.tokenizer
    if a is not None and b is not None and (len(a) != len(b) or a.get_vocab() != b.get_vocab()):
        raise QuantkitError(f"the baseline and the quantized model have different vocabularies ({len(a):,} and {len(b):,} "
                            "tokens): compare a checkpoint with the model it was quantized from (--baseline)")


def _fields(cfg: EvalConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__slots__}
