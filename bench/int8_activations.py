"""What `--activations int8` costs in accuracy: KL to the dense baseline of a W4 checkpoint with float32 activations
and with int8 ones, on the same held-out tokens.

    python bench/int8_activations.py W4_CHECKPOINT BASELINE [--rows 8] [--window 32] [--json]

Int8 activations apply to inputs of up to 32 rows (decode steps, short prefill chunks), so the held-out rows
(`quantkit eval`'s built-in text) are scored in windows of `--window` tokens, each from a fresh context: every
position of both runs goes through the same kernels a decode step uses. Prints mean KL (nats) of each against the
dense model, the KL between the two W4 runs, their top-1 agreement, and the perplexity of each.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("baseline")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from quantkit.calib.data import eval_rows
    from quantkit.eval.kl import token_stats
    from quantkit.models import resolve
    from quantkit.runtime import EngineConfig, LLMEngine
    from quantkit.runtime.layers.linear import F32_PANEL_MAX_ROWS

    if not 2 <= args.window <= F32_PANEL_MAX_ROWS:
        raise SystemExit(f"--window: 2-{F32_PANEL_MAX_ROWS} tokens (int8 activations apply up to {F32_PANEL_MAX_ROWS} rows)")
    engines = {"dense": LLMEngine(resolve(args.baseline).path, EngineConfig(dtype="fp32")),
               "w4 float": LLMEngine(resolve(args.checkpoint).path, EngineConfig(dtype="fp32")),
               "w4 int8": LLMEngine(resolve(args.checkpoint).path, EngineConfig(dtype="fp32", activations="int8"))}
    rows = torch.as_tensor(eval_rows(engines["dense"].tokenizer, 512, args.rows))  # [rows, 512]
    windows = rows[:, : rows.shape[1] // args.window * args.window].reshape(-1, args.window)
    stats: dict[str, list] = {k: [] for k in ("dense|float", "dense|int8", "float|int8", "agree", "nll dense", "nll float", "nll int8")}
    with torch.no_grad():
        for w in windows:
            logits = {k: e.model(e.single(w[:-1], all_logits=True), e.cache) for k, e in engines.items()}
            target = w[1:].unsqueeze(0)
            kl_f, _, nll_d, nll_f = token_stats(logits["dense"][None], logits["w4 float"][None], target)
            kl_i, _, _, nll_i = token_stats(logits["dense"][None], logits["w4 int8"][None], target)
            kl_fi, agree, _, _ = token_stats(logits["w4 float"][None], logits["w4 int8"][None], target)
            for key, v in zip(stats, (kl_f, kl_i, kl_fi, agree.float(), nll_d, nll_f, nll_i)):
                stats[key].append(v.flatten())
    mean = {k: torch.cat(v).mean().item() for k, v in stats.items()}
    out = {"tokens": int(sum(len(v) for v in stats["agree"])), "window": args.window,
           "kl_dense_w4_float": mean["dense|float"], "kl_dense_w4_int8": mean["dense|int8"], "kl_float_int8": mean["float|int8"],
           "top1_float_int8": mean["agree"], "ppl": {k: float(torch.exp(torch.tensor(mean[f"nll {k}"]))) for k in ("dense", "float", "int8")}}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['tokens']:,} tokens in windows of {args.window}: KL to dense, W4 float32 activations {out['kl_dense_w4_float']:.4f}, "
          f"int8 {out['kl_dense_w4_int8']:.4f}; between the two {out['kl_float_int8']:.4f} (top-1 agreement "
          f"{100 * out['top1_float_int8']:.1f}%); ppl dense {out['ppl']['dense']:.2f}, float {out['ppl']['float']:.2f}, "
          f"int8 {out['ppl']['int8']:.2f}")


if __name__ == "__main__":
    main()
