"""Speculative decoding against the plain engine on the same prompts, side by side in one process.

    python bench/speculative.py MODEL [--draft DRAFT] [--workloads copy,code,chat] [--batch-sizes 1,8,32] [--k 4]
                                      [--max-tokens 128] [--repeats 2] [--json]

Workloads, all through the model's chat template, greedy (so both engines produce the same tokens and the
comparison is of time alone):
  copy  repeat a passage of the built-in held-out text (questions answered from a pasted context copy the same way)
  code  edit in place: rename one identifier in a function of quantkit's own source, and return the whole code
  chat  open-ended questions with nothing to copy (where n-gram drafts should cost little)
Engines: plain, n-gram drafts, and with `--draft` a draft model (same tokenizer). For each batch size they
alternate, `--repeats` times each; each line shows output tokens per second (median, decoding only: from the last first token to the end), the speedup over plain,
the acceptance rate, the tokens each verifying step added, and whether the outputs equal plain decoding's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

QUESTIONS = ["Why is the sky blue?", "Give three tips for learning to cook.", "What makes a good friend?",
             "Explain what a hash table is.", "Write a short poem about autumn.", "How do plants make food?",
             "What should I pack for a weekend trip?", "Describe the water cycle."]


def workload(name: str, tok, n: int) -> list[list[int]]:
    """n chat prompts (token ids) of one workload."""
    from quantkit.calib.data import builtin_texts

    if name == "copy":
        texts = [t for t in builtin_texts("eval") if len(t) > 400]
        asks = [f"Repeat this text exactly:\n\n{texts[i % len(texts)][:500]}" for i in range(n)]
    elif name == "code":
        asks = [f"Rename `{old}` to `{old}_v2` in this code and return the whole code:\n\n```python\n{src}```"
                for old, src in _functions(n)]
    elif name == "chat":
        asks = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    else:
        raise SystemExit(f"unknown workload {name}: use copy, code, chat")
    return [tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True) for a in asks]


def _functions(n: int) -> list[tuple[str, str]]:
    """Short functions of quantkit itself (5-25 lines), with one local name each to rename."""
    from quantkit.runtime import block_manager, sampler, scheduler, speculative

    out = []
    for module in (sampler, speculative, block_manager, scheduler):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            src = inspect.getsource(fn)
            if fn.__module__ == module.__name__ and 5 <= src.count("\n") <= 25:
                out.append((name, src))
    return [out[i % len(out)] for i in range(n)]


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    """-> (decode seconds: from the last request's first token to the end, tokens decoded in them, outputs) for
    the prompts submitted together; prefill is left out, since speculation changes decoding only."""
    from quantkit.runtime.sampler import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    done, count, start, before = {}, {}, None, 0
    while engine.has_unfinished():
        for o in engine.step():
            count[o.id] = len(o.token_ids)
            if o.finished:
                done[o.id] = o.token_ids
        if start is None and len(count) == len(ids):  # every request has its first token: decoding from here
            start, before = time.perf_counter(), sum(count.values())
    outs = [done[i] for i in ids]
    return time.perf_counter() - start, sum(map(len, outs)) - before, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--draft", help="a draft model (directory or alias) to compare as well")
    ap.add_argument("--no-ngram", action="store_true", help="leave the n-gram engine out")
    ap.add_argument("--workloads", default="copy,code,chat")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=4, help="speculation off above this many running sequences")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from quantkit.models import resolve
    from quantkit.runtime import EngineConfig, LLMEngine
    from quantkit.runtime.speculative import SpeculativeConfig, acceptance

    path = resolve(args.model).path
    specs = {} if args.no_ngram else {"ngram": SpeculativeConfig("ngram", args.k, args.ngram_min, args.ngram_max, args.max_batch)}
    if args.draft:
        specs["draft"] = SpeculativeConfig("draft", args.k, max_batch=args.max_batch, model=args.draft)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for b in sizes:
        engines = {name: LLMEngine(path, EngineConfig(dtype=args.dtype, max_num_seqs=b, speculative=s))
                   for name, s in (("plain", None), *specs.items())}
        for e in engines.values():
            e.warm_up()
        for w in args.workloads.split(","):
            prompts = workload(w, engines["plain"].tokenizer, b)
            times = {name: [] for name in engines}
            for name in specs:
                engines[name].reset_spec_stats()
            for _ in range(args.repeats):
                outs = {}
                for name, e in engines.items():
                    seconds, tokens, outs[name] = run(e, prompts, args.max_tokens)
                    times[name].append(tokens / seconds)
            plain = statistics.median(times["plain"])
            for name in specs:
                a = acceptance(engines[name].spec_stats)
                tok_s = statistics.median(times[name])
                rows.append({"workload": w, "batch": b, "method": name, "plain_tok_s": plain, "tok_s": tok_s,
                             "speedup": tok_s / plain, "acceptance_rate": a["acceptance_rate"],
                             "mean_acceptance_length": a["mean_acceptance_length"], "verifying_steps": a["drafts"],
                             "same_tokens": outs[name] == outs["plain"], "runs": {"plain": times["plain"], name: times[name]}})
                r = rows[-1]
                if not args.json:
                    print(f"{w:5} batch {b:3} {name:5}: plain {plain:7.1f} tok/s, {name} {tok_s:7.1f} tok/s, {r['speedup']:.2f}x; "
                          f"acceptance {r['acceptance_rate']:.2f}, {r['mean_acceptance_length']:.2f} tokens/verifying step "
                          f"({r['verifying_steps']} steps); outputs identical: {r['same_tokens']}", flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "draft": args.draft, "k": args.k, "ngram": [args.ngram_min, args.ngram_max],
                          "max_batch": args.max_batch, "max_tokens": args.max_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
