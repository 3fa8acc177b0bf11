"""What 5- and 6-bit Linears buy a KL budget over 4 and 8 bits alone: predicted, from the budget's own sensitivities.

Every engine runs 4- and 8-bit weights; 5 and 6 bits (`--choices w6g64`) load in HF transformers and quantkit's runtime,
but in vLLM only through its Humming kernels on CUDA. This asks how much smaller the cheapest mix gets with them,
without writing any checkpoint: the budget's sensitivity pass (round-to-nearest error against the Fisher diagonal,
`quantkit.budget.sensitivity`) over every unit and every choice, then the budget's own knapsack (`plan.choose`) at each predicted-KL limit, once with the engine formats
alone and once with every choice. Sizes are the checkpoint's (`plan.unit_bytes`: values packed densely, 6 bits
0.75 bytes a weight, plus scales in the checkpoint dtype). Usage:

    python bench/budget_formats.py smollm2-135m --choices w4g32,w5g64,w6,w6g64,w8,dense --limits 0.0041,0.006
    python bench/budget_formats.py qwen2.5-coder-1.5b --choices w4g64,w6g64,w8,dense --limits 0.0011 --json

A limit is a *predicted* KL: a real budget run re-aims by its measured / predicted ratio, so pass the prediction
its rounds settled on (what `quantize --budget kl=... --json` reports) to compare at the same measured KL.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

def main() -> None:
    from transformers import AutoModelForCausalLM

    from quantkit.arch import arch_of
    from quantkit import QuantkitError
    from quantkit.budget.plan import choose, parse_choice, table_units, unit_bytes, units_of, with_table_choices
    from quantkit.config import KERNEL_BITS
    from quantkit.budget.sensitivity import sensitivities
    from quantkit.calib.data import CalibConfig, build
    from quantkit.models import decoder_layers, load_tokenizer, quiet_transformers, read_config, resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--choices", default="w4g32,w6g64,w8,dense")
    ap.add_argument("--limits", default="0.0041", help="predicted mean KL limits, comma-separated")
    ap.add_argument("--rows", type=int, default=16, help="calibration rows of 512 tokens (the budget reads 16)")
    ap.add_argument("--no-tables", action="store_true", help="keep the vocabulary tables dense (as --embeddings dense)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    try:
        choices = [parse_choice(c.strip()) for c in args.choices.split(",") if c.strip()]
        limits = [float(x) for x in args.limits.split(",")]
    except (QuantkitError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    resolved = resolve(args.model)
    arch = arch_of(read_config(resolved.path), resolved.path)
    tokenizer = load_tokenizer(resolved.path)
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    units = units_of(decoder_layers(model), "model.layers", arch)
    if not args.no_tables:
        units += table_units(model)
        choices = with_table_choices(choices)
    rows = build(CalibConfig(), tokenizer).ids[: args.rows]
    start = time.perf_counter()
    sens = sensitivities(model, units, choices, rows, torch.bfloat16)
    seconds = time.perf_counter() - start
    unit_params = sum(o * i for u in units for o, i in u.shapes)
    fixed = (sum(p.numel() for p in model.parameters()) - unit_params) * 2  # norms, and what no unit holds
    w8, dense = parse_choice("w8"), parse_choice("dense")
    uniform_w8 = fixed + sum(unit_bytes(u, dense if u.table else w8) for u in units)  # uniform W8 keeps tables dense

    results = []
    for name, pool in (("engine formats (4 and 8 bits)", [c for c in choices if c.scheme is None or c.scheme.bits in KERNEL_BITS]),
                       ("every choice", choices)):
        options = {u.name: {c.label: (unit_bytes(u, c), sens[u.name][c.label]) for c in pool if c.label in sens[u.name]}
                   for u in units}  # (the sensitivities hold the choices that fit each unit: a table's are int8 rows or dense)
        for limit in limits:
            plan = choose(units, options, pool, limit, None)
            counts: dict[str, int] = {}
            for c in plan.mix.values():
                counts[c.label] = counts.get(c.label, 0) + 1
            size = fixed + plan.bytes
            results.append({"pool": name, "limit": limit, "predicted_kl": plan.predicted_kl, "bytes": size,
                            "smaller_than_w8": 1 - size / uniform_w8, "counts": counts})
    report = {"model": args.model, "choices": [c.label for c in choices], "rows": args.rows,
              "sensitivity_s": round(seconds, 1), "uniform_w8_bytes": uniform_w8, "results": results}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{args.model}: uniform W8 {uniform_w8 / 1e6:.1f} MB; sensitivity pass {seconds:.0f} s over {args.rows} rows")
    print(f"| choices | predicted KL limit | size (MB) | smaller than W8 | mix |\n| --- | ---: | ---: | ---: | --- |")
    for r in results:
        mix = ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items()))
        print(f"| {r['pool']} | {r['limit']:g} | {r['bytes'] / 1e6:.1f} | {100 * r['smaller_than_w8']:.1f}% | {mix} |")


if __name__ == "__main__":
    main()
