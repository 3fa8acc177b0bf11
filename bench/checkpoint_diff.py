"""Two quantized checkpoints of one model, compared where their difference comes from: layer by layer and end to end.

For GPTQ against llm-compressor (or any two quantizations of the same dense model), on the same held-out rows:
- layers: each decoder layer run on the dense model's own inputs to it, with its Linears replaced by A's, then by
  B's dequantized weights; the error of its output against the dense layer's, relative to what the layer adds to
  the residual stream. This isolates each layer's quantization from the errors of the layers before it.
- codes: the share of int4 codes and of scales that differ between A and B, per layer.
- KL: mean KL(dense || A) and (dense || B) per held-out row (HF transformers, float32), and a paired bootstrap
  interval of the difference over rows: whether a gap between the two generalizes beyond these rows.

    python bench/checkpoint_diff.py A B --model qwen2.5-coder-1.5b [--rows 32 --layer-rows 8 --seqlen 512]

Prints a Markdown table per layer and the KL comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor, nn


def dequantized(path: Path) -> dict[str, Tensor]:
    """Every quantized Linear of a compressed-tensors checkpoint -> its float32 weight [out, in]."""
    from quantkit.formats.load import dequantize_module, quant_config_of, read_tensors, scheme_for

    tensors, config = read_tensors(path), quant_config_of(path)
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
    return {m: dequantize_module(tensors, m, scheme_for(m, config), torch.float32) for m in modules}


@torch.no_grad()
def layer_errors(model: nn.Module, rows: Tensor, weights: list[dict[str, Tensor]]) -> list[list[float]]:
    """Per layer, per weight set: mean((out_q - out)^2) / mean((out - in)^2) on the dense model's inputs to it."""
    layers = model.model.layers
    kwargs: dict = {}

    def grab(module, args, kw):
        kwargs.update({k: v for k, v in kw.items() if k not in ("past_key_values", "past_key_value", "use_cache")})

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    hidden = model(rows, output_hidden_states=True, use_cache=False).hidden_states  # [layers + 1] x [b, seq, d]
    handle.remove()
    out = []
    for i, layer in enumerate(layers):
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        dense = {n: m.weight.data for n, m in linears.items()}

        def run() -> Tensor:
            y = layer(hidden[i], **kwargs)
            return y[0] if isinstance(y, tuple) else y

        ref = run()
        update = ((ref - hidden[i]) ** 2).mean()
        errs = []
        for w in weights:
            for n, m in linears.items():
                m.weight.data = w[f"model.layers.{i}.{n}"]
            errs.append((((run() - ref) ** 2).mean() / update).item())
        for n, m in linears.items():
            m.weight.data = dense[n]
        out.append(errs)
    return out


def code_diff(a: Path, b: Path, layer: int) -> tuple[float, float]:
    """Share of differing codes and scales over one layer's quantized Linears."""
    from quantkit.formats.load import quant_config_of, read_tensors, scheme_for, unpacked_module

    ta, tb = read_tensors(a), read_tensors(b)
    ca, cb = quant_config_of(a), quant_config_of(b)
    prefix = f"model.layers.{layer}."
    codes = scales = total_c = total_s = 0
    for m in sorted({k.rsplit(".", 1)[0] for k in ta if k.startswith(prefix) and k.endswith(".weight_packed")}):
        qa, sa, _ = unpacked_module(ta, m, scheme_for(m, ca))
        qb, sb, _ = unpacked_module(tb, m, scheme_for(m, cb))
        codes += (qa != qb).sum().item()
        scales += (sa != sb).sum().item()
        total_c, total_s = total_c + qa.numel(), total_s + sa.numel()
    return codes / total_c, scales / total_s


def row_kl(dense: Path, path: Path, rows: Tensor) -> Tensor:
    """Mean KL(dense || path) per row [rows], HF transformers in float32."""
    from quantkit.eval.backends import HFBackend
    from quantkit.eval.kl import distribution

    d = distribution(HFBackend(dense, "dense", torch.float32), HFBackend(path, "quantized", torch.float32), rows)
    return d.kl_per_token.reshape(rows.shape[0], -1).mean(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--model", required=True, help="the dense model both were quantized from (any MODEL quantkit resolves)")
    ap.add_argument("--rows", type=int, default=32, help="held-out rows for KL (0: skip)")
    ap.add_argument("--layer-rows", type=int, default=8, help="held-out rows for the per-layer errors (0: skip)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for path in (args.a, args.b):
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path}: not a checkpoint folder (no config.json)")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calib.data import eval_rows
    from quantkit.eval.stats import paired_bootstrap_ci
    from quantkit.models import resolve

    dense = resolve(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(dense)
    result: dict = {"a": str(args.a), "b": str(args.b), "model": args.model}
    if args.layer_rows:
        model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
        errs = layer_errors(model, eval_rows(tokenizer, args.seqlen, args.layer_rows), [dequantized(args.a), dequantized(args.b)])
        del model
        result["layers"] = [{"layer": i, "error_a": ea, "error_b": eb, "codes_differ": c, "scales_differ": s}
                            for i, (ea, eb) in enumerate(errs) for c, s in [code_diff(args.a, args.b, i)]]
    if args.rows:
        rows = eval_rows(tokenizer, args.seqlen, args.rows)
        ka, kb = row_kl(dense, args.a, rows), row_kl(dense, args.b, rows)
        lo, hi = paired_bootstrap_ci(kb, ka)  # of mean(a) - mean(b)
        result["kl"] = {"rows": args.rows, "tokens": rows[:, 1:].numel(), "a": ka.mean().item(), "b": kb.mean().item(),
                        "diff": (ka - kb).mean().item(), "ci90": [lo, hi], "rows_a_lower": int((ka < kb).sum())}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if "layers" in result:
        print(f"Layer output error on the dense model's inputs ({args.layer_rows} x {args.seqlen} held-out tokens), "
              "relative to the layer's own update; A = first checkpoint, B = second\n")
        print("| layer | error A | error B | A / B | codes differ | scales differ |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in result["layers"]:
            print(f"| {r['layer']} | {r['error_a']:.5f} | {r['error_b']:.5f} | {r['error_a'] / r['error_b']:.3f} | "
                  f"{r['codes_differ']:.1%} | {r['scales_differ']:.1%} |")
        ta, tb = sum(r["error_a"] for r in result["layers"]), sum(r["error_b"] for r in result["layers"])
        wins = sum(r["error_a"] < r["error_b"] for r in result["layers"])
        print(f"\nsum over layers: A {ta:.4f}, B {tb:.4f}; A lower on {wins} of {len(result['layers'])} layers")
    if "kl" in result:
        k = result["kl"]
        print(f"\nmean KL on {k['rows']} x {args.seqlen} held-out tokens: A {k['a']:.5f}, B {k['b']:.5f}; A - B = {k['diff']:+.5f}, "
              f"90% CI [{k['ci90'][0]:+.5f}, {k['ci90'][1]:+.5f}] (paired bootstrap over rows); A lower on {k['rows_a_lower']} rows")


if __name__ == "__main__":
    main()
