"""The `quantize` job: resolve and load MODEL, quantize its decoder Linears, write the checkpoint.

This is the only place that strings the stages together; each stage lives in its own module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch import nn

import quantkit
from quantkit.config import Recipe
from quantkit.formats.save import check_output, quantization_config, save_checkpoint
from quantkit.models import (
    DTYPES,
    check_supported,
    decoder_layers,
    load_model,
    load_tokenizer,
    read_config,
    resolve,
    source_dtype,
    source_hash,
    weight_files,
)
from quantkit.quant.apply import find_targets, matches, quantize_model, resolve_group_size
from quantkit.ui import Reporter


@dataclass(slots=True)
class QuantizeResult:
    out: Path
    recipe: Recipe
    model: nn.Module  # fake-quantized in place: what the checkpoint dequantizes to
    quantized_modules: int
    dense_bytes: int
    out_bytes: int
    files: list[str]
    timings_s: dict[str, float]
    notes: list[str]

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "recipe": self.recipe.to_dict(),
            "quantized_modules": self.quantized_modules,
            "dense_bytes": self.dense_bytes,
            "out_bytes": self.out_bytes,
            "compression": round(self.dense_bytes / max(self.out_bytes, 1), 3),
            "files": self.files,
            "timings_s": self.timings_s,
            "notes": self.notes,
        }


def dense_ignore(model: nn.Module, patterns: list[str], quantized: set[str]) -> list[str]:
    """The config's `ignore`: our patterns plus every other Linear left dense (targets say "Linear")."""
    extra = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in quantized and not any(matches(name, m, p) for p in patterns)
    ]
    return [*patterns, *extra]


def run_quantize(spec: str, out: Path, recipe: Recipe, max_shard_bytes: int, force: bool, ui: Reporter) -> QuantizeResult:
    timings: dict[str, float] = {}
    notes: list[str] = []
    check_output(out, force)
    start = time.perf_counter()
    with ui.step(f"resolving {spec}"):
        resolved = resolve(spec, status=ui.note)
    config = read_config(resolved.path)
    check_supported(config, resolved.path)
    recipe.dtype = recipe.dtype or source_dtype(config)
    dtype = DTYPES[recipe.dtype]
    with ui.step(f"loading {spec}"):
        model = load_model(resolved, dtype)
        tokenizer = load_tokenizer(resolved.path)
    if tokenizer is None:
        notes.append(f"no tokenizer in {resolved.path}; the checkpoint will have none")
    timings["load"] = round(time.perf_counter() - start, 3)

    start = time.perf_counter()
    layers = decoder_layers(model)
    targets = find_targets(layers, "model.layers", recipe.ignore)
    if note := resolve_group_size(recipe, targets):
        notes.append(note)
        ui.note(note)
    with ui.bar(f"quantizing ({recipe.method}, int{recipe.bits})", len(layers)) as advance:
        qweights = quantize_model(targets, recipe, dtype, on_layer=lambda i: advance())
    timings["quantize"] = round(time.perf_counter() - start, 3)

    start = time.perf_counter()
    with ui.step("hashing source weights"):
        files = [resolved.source_file] if resolved.source_file else weight_files(resolved.path)
        digest = source_hash(files)
    timings["hash"] = round(time.perf_counter() - start, 3)
    manifest = {
        "quantkit_version": quantkit.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe.to_dict(),
        "source": {"model": spec, "kind": resolved.kind, "files": [f.name for f in files], "sha256": digest},
        "timings_s": dict(timings),
        "notes": notes,
    }
    qconfig = quantization_config(recipe.scheme(), dense_ignore(model, recipe.ignore, set(qweights)))
    with ui.bar("saving", None) as advance:
        names = save_checkpoint(out, model, tokenizer, qweights, qconfig, manifest, max_shard_bytes, force,
                                on_shard=lambda i, n: advance(1, total=n))
    timings["save"] = manifest["timings_s"]["save"]
    params = sum(p.numel() for p in model.parameters())  # tied weights count once
    return QuantizeResult(
        out=out,
        recipe=recipe,
        model=model,
        quantized_modules=len(qweights),
        dense_bytes=params * 2,
        out_bytes=sum((out / n).stat().st_size for n in names),
        files=names,
        timings_s=timings,
        notes=notes,
    )
