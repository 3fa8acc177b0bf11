"""Peer side of quantkit's GPTQ benchmark: quantize a checkpoint with llm-compressor.

quantkit's GPTQ is judged against llm-compressor, the reference producer of the
compressed-tensors format that quantkit writes.  This script runs llm-compressor's
`oneshot` with the same inputs quantkit gets -- a dense Llama checkpoint, the exact
calibration token rows (a JSONL file of equal-length `{"input_ids": [...]}` rows) and
a W4A16 symmetric group scheme -- and reports its wall time and peak memory, so that
the two tools can be compared side by side on the same machine.

It runs in its own virtual env with llmcompressor installed (which pins its own
torch and transformers) and deliberately does not import quantkit.

    python bench/peer_llmcompressor.py --model DIR --calib CALIB.jsonl \
        --method gptq --group-size 64 --out OUTDIR --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

DTYPES = ("auto", "bfloat16", "float16", "float32")


def read_calib(path: Path) -> list[list[int]]:
    """The calibration rows, checked to be non-empty and all of one length."""
    rows = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no calibration rows")
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise SystemExit(f"{path}: rows differ in length ({sorted(lengths)})")
    return rows


def w4a16_group(group_size: int) -> dict[str, Any]:
    """W4A16, symmetric int4 weights in groups of `group_size`, every Linear but lm_head."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}


def make_modifier(method: str, group_size: int) -> GPTQModifier | QuantizationModifier:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    scheme = w4a16_group(group_size)
    if method == "gptq":
        # block_size and dampening_frac are llm-compressor's defaults, spelled out;
        # actorder is left to its default for group weights (static).
        return GPTQModifier(block_size=128, dampening_frac=0.01, **scheme)
    return QuantizationModifier(**scheme)


def quantization_settings(out: Path, modifier: GPTQModifier | QuantizationModifier) -> dict[str, Any]:
    """The settings llm-compressor actually applied, read back from the saved checkpoint's config."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    settings = {"format": config["format"], "observer": weights["observer"], "actorder": weights["actorder"]}
    if isinstance(modifier, GPTQModifier):
        settings |= {"block_size": modifier.block_size, "dampening_frac": modifier.dampening_frac}
    return settings


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Route fd 1 to stderr, so stdout stays clean for the JSON line: llm-compressor's
    loguru sink holds its own reference to sys.stdout, which redirect_stdout can't move."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def quantize(args: argparse.Namespace, rows: list[list[int]]) -> dict[str, Any]:
    """Load, quantize with `oneshot` and save; the timings and settings of that run."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    modifier = make_modifier(args.method, args.group_size)
    calib: dict[str, Any] = {}
    if rows:
        dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
        calib = {
            "dataset": dataset,
            "num_calibration_samples": len(rows),
            "max_seq_length": len(rows[0]),
            "shuffle_calibration_samples": False,
        }
    q_start = time.perf_counter()
    oneshot(model=model, tokenizer=tokenizer, recipe=modifier, **calib)
    quantize_s = time.perf_counter() - q_start
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    return {
        "quantize_s": round(quantize_s, 3),
        "total_s": round(time.perf_counter() - start, 3),
        "dtype": str(model.dtype).removeprefix("torch."),
        "settings": quantization_settings(args.out, modifier),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="dense Hugging Face checkpoint directory")
    ap.add_argument("--calib", type=Path, help='JSONL of {"input_ids": [...]} rows, all one length (gptq only)')
    ap.add_argument("--method", choices=("gptq", "rtn"), default="gptq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="load dtype (default: the checkpoint's)")
    ap.add_argument("--out", type=Path, required=True, help="where to save the compressed checkpoint")
    ap.add_argument("--json", action="store_true", help="print one JSON result object on stdout")
    args = ap.parse_args(argv)
    if args.method == "gptq" and args.calib is None:
        ap.error("--calib is required for gptq")

    rows = read_calib(args.calib) if args.method == "gptq" else []  # rtn is data-free
    with stdout_to_stderr():  # the libraries log to stdout from import time on
        run = quantize(args, rows)
    result = {
        "tool": "llm-compressor",
        "version": version("llmcompressor"),
        "method": args.method,
        "group_size": args.group_size,
        "calib_rows": len(rows),
        "calib_seqlen": len(rows[0]) if rows else 0,
        "quantize_s": run["quantize_s"],
        "total_s": run["total_s"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "out": str(args.out),
        "dtype": run["dtype"],
        "settings": run["settings"],
    }
    calib_note = f"{len(rows)}x{len(rows[0])} calibration tokens" if rows else "no calibration data"
    print(
        f"llm-compressor {result['version']}: {args.method} int4 g{args.group_size} on {args.model.name}, "
        f"{calib_note}\n"
        f"  quantize {run['quantize_s']:.1f}s, total {run['total_s']:.1f}s, "
        f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB\n"
        f"  settings {run['settings']}\n  saved to {args.out}",
        file=sys.stderr if args.json else sys.stdout,
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
