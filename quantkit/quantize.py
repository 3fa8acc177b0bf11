"""The `quantize` job: resolve MODEL, walk its decoder layers one at a time, stream the checkpoint out.

Only the current layer's weights are in memory (read by name from the safetensors shards), plus the
calibration activations and at most one output shard, so models larger than memory quantize too.
This module strings the stages together; each stage lives in its own module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quantkit
from quantkit import QuantkitError
from quantkit.arch import Arch, arch_of
from quantkit.calib.data import CalibConfig, build
from quantkit.calib.sequential import (
    MIN_EXPERT_TOKENS,
    Batch,
    LayerResult,
    first_layer_inputs,
    quantize_layer,
)
from quantkit.config import Recipe, Scheme
from quantkit.formats.load import SafetensorsSource
from quantkit.formats.save import (
    MANIFEST_NAME,
    ShardWriter,
    atomic_dir,
    check_output,
    compressed_tensors_of,
    quantization_config,
    write_manifest,
    write_metadata,
)
from quantkit.memory import peak_rss_bytes, return_freed_memory
from quantkit.models import (
    DTYPES,
    ResolvedModel,
    checkpoint_parts,
    decoder_layers,
    load_layer,
    load_tokenizer,
    read_config,
    release_layer,
    resolve,
    skeleton,
    source_dtype,
    source_hash,
    weight_files,
)
from quantkit.quant.apply import Target, find_targets, matches, resolve_group_size, routers, vocab_tables
from quantkit.quant.kv_fp8 import kv_scale
from quantkit.quant.rtn import rtn
from quantkit.ui import Reporter

CALIB_BATCH = 8  # calibration rows run through a layer at once


@dataclass(slots=True)
class QuantizeResult:
    out: Path
    recipe: Recipe
    quantized_modules: int
    dense_bytes: int
    out_bytes: int
    files: list[str]
    timings_s: dict[str, float]
    peak_rss_bytes: int
    calibration: str | None = None
    notes: list[str] = field(default_factory=list)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # sparse layer -> calibration tokens per expert

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "recipe": self.recipe.to_dict(),
            "calibration": self.calibration,
            "quantized_modules": self.quantized_modules,
            "dense_bytes": self.dense_bytes,
            "out_bytes": self.out_bytes,
            "compression": round(self.dense_bytes / max(self.out_bytes, 1), 3),
            "files": self.files,
            "timings_s": self.timings_s,
            "peak_rss_bytes": self.peak_rss_bytes,
            "notes": self.notes,
            "expert_tokens": self.expert_tokens,
        }


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise QuantkitError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if device not in ("cpu", "cuda"):
        raise QuantkitError(f"--device must be cpu, cuda or auto, got {device!r}")
    return device


def compute_dtype(dtype: torch.dtype, device: str, method: str = "gptq") -> torch.dtype:
    """The dtype the layer walk runs in, chosen for the machine as the runtime chooses its activations: the
    checkpoint's 16-bit dtype on CUDA; for the methods that calibrate weights (GPTQ, AWQ: forwards and
    Hessian products are their time), bf16 on a CPU only where it has native bf16 dot products (AVX512_BF16 or
    AMX: there bf16 GEMMs are ~2.5x float32's) and float32 elsewhere, where bf16 GEMMs are emulated and slower;
    RTN, whose one forward only measures KV-cache scales, keeps bf16 and so half the memory of a float32 layer.
    fp16 on a CPU always runs in float32 (no fast fp16 GEMM). Hessians always accumulate in float32."""
    from quantkit.kernels.fused import native_bf16

    if device == "cuda" or (dtype == torch.bfloat16 and (method not in ("gptq", "awq") or native_bf16())):
        return dtype
    return torch.float32


def dense_ignore(model: nn.Module, patterns: list[str], quantized: set[str]) -> list[str]:
    """The config's `ignore`: our patterns (less a head quantized by name: ignore outranks targets) plus every other
    Linear left dense (targets say "Linear")."""
    patterns = [p for p in patterns if p not in quantized]
    extra = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in quantized and not any(matches(name, m, p) for p in patterns)
    ]
    return [*patterns, *extra]


def by_layer(targets: list[Target], n: int) -> list[list[Target]]:
    out: list[list[Target]] = [[] for _ in range(n)]
    for t in targets:
        out[t.layer].append(t)
    return out


def walk(
    layers: nn.ModuleList,
    targets: list[list[Target]],
    batches: list[Batch] | None,
    recipe: Recipe,
    scale_dtype: torch.dtype,
    arch: Arch,
    load: Callable[[int, nn.Module], None] = lambda i, layer: None,
    release: Callable[[nn.Module], None] = lambda layer: None,
) -> Iterator[tuple[int, nn.Module, LayerResult]]:
    """Quantize layer after layer; yields each finished layer (still materialized) with its result."""
    for i, layer in enumerate(layers):
        load(i, layer)
        result, batches = quantize_layer(layer, f"model.layers.{i}", targets[i], batches, recipe, scale_dtype, arch)
        yield i, layer, result
        del result  # the caller has it: not alive (nor its integers on the heap) while the next layer is solved
        release(layer)


def calibration_batches(model, layers, recipe: Recipe, calib: CalibConfig, tokenizer, device: str, notes: list[str], ui: Reporter):
    if not recipe.needs_calibration:
        return None, None
    with ui.step("tokenizing calibration data"):
        calib_set = build(calib, tokenizer)
    for w in calib_set.warnings:
        notes.append(w)
        ui.note(w)
    with ui.step("computing the first layer's inputs"):
        batches = first_layer_inputs(model, layers, calib_set.ids, CALIB_BATCH, device)
    return batches, f"{calib.source}: {calib_set.describe()}, seed {calib.seed}"


def write_layer(writer: ShardWriter, layer: nn.Module, prefix: str, result: LayerResult, recipe: Recipe, dtype: torch.dtype,
                arch: Arch) -> None:
    for key, tensor in layer.state_dict().items():
        for name, part in checkpoint_parts(key, tensor, arch):
            module = f"{prefix}.{name.removesuffix('.weight')}"
            if name.endswith(".weight") and module in result.qweights:
                for packed, t in compressed_tensors_of(module, result.qweights[module]).items():
                    writer.add(packed, t)
            else:
                writer.add(f"{prefix}.{name}", part.to(dtype))
    for kind, amax in result.kv_absmax.items():
        writer.add(f"{prefix}.self_attn.{kind}_scale", kv_scale(amax, recipe.kv_strategy, dtype))


def few_tokens_note(layer: str, tokens: list[int]) -> str | None:
    """The warning for a sparse layer's experts that the calibration rows hardly reach (the fallback is
    `calib.sequential.Routed.inputs`)."""
    few = [(e, n) for e, n in enumerate(tokens) if n < MIN_EXPERT_TOKENS]
    if not few:
        return None
    return (f"{layer}: expert{'s' * (len(few) > 1)} {', '.join(str(e) for e, _ in few)} received fewer than "
            f"{MIN_EXPERT_TOKENS} calibration tokens ({', '.join(str(n) for _, n in few)}); calibrated on all of the "
            "layer's tokens instead (more or more varied calibration rows reach them)")


def open_source(spec: str, recipe: Recipe, ui: Reporter) -> tuple[ResolvedModel, dict, Arch]:
    """Resolve MODEL, read its config and family, and settle the checkpoint dtype (the model's own when unset)."""
    with ui.step(f"resolving {spec}"):
        resolved = resolve(spec, status=ui.note)
    config = read_config(resolved.path)
    if (done := config.get("quantization_config")) is not None:
        raise QuantkitError(f"{spec} is already quantized ({done.get('quant_method', 'a quantization_config')}): quantize "
                            f"its dense baseline{_baseline_hint(resolved.path)}")
    arch = arch_of(config, resolved.path)
    recipe.dtype = recipe.dtype or source_dtype(config)
    return resolved, config, arch


def _baseline_hint(path: Path) -> str:
    """", MODEL" when a quantkit checkpoint's manifest names the model it was made from."""
    try:
        source = json.loads((path / MANIFEST_NAME).read_text())["source"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f", {source}"


def run_quantize(
    spec: str,
    out: Path,
    recipe: Recipe,
    max_shard_bytes: int,
    force: bool,
    ui: Reporter,
    calib: CalibConfig | None = None,
    device: str = "auto",
    mix: dict[str, Scheme] | None = None,
) -> QuantizeResult:
    """`mix`: module name -> scheme for each Linear to quantize (a budget's choice; the others stay dense); None: the
    recipe's scheme on every Linear."""
    calib = calib or CalibConfig()
    return_freed_memory()
    timings: dict[str, float] = {}
    notes: list[str] = []
    check_output(out, force)
    device = pick_device(device)
    start = time.perf_counter()
    resolved, config, arch = open_source(spec, recipe, ui)
    dtype = DTYPES[recipe.dtype]
    if recipe.method.startswith("bnb"):
        from quantkit.formats.bnb import run_bnb

        return run_bnb(resolved, out, recipe, force, ui)
    forward = compute_dtype(dtype, device, recipe.method)
    with ui.step(f"reading {spec}"):
        model = skeleton(resolved.path, forward, device)
        source = SafetensorsSource(resolved.path)
        tokenizer = load_tokenizer(resolved.path)
    if tokenizer is None:
        notes.append(f"no tokenizer in {resolved.path}; the checkpoint will have none")
    layers = decoder_layers(model)
    targets = find_targets(layers, "model.layers", recipe.ignore, arch) if recipe.scheme() or mix else []
    if mix is not None:
        targets = [Target(t.layer, t.name, t.module, mix[t.name]) for t in targets if t.name in mix]
    elif note := resolve_group_size(recipe, targets):
        notes.append(note)
        ui.note(note)
    tables = vocab_tables(config, recipe, mix)
    batches, calibration = calibration_batches(model, layers, recipe, calib, tokenizer, device, notes, ui)
    release_layer(model.get_input_embeddings())  # the first layer's inputs exist; the writer reads it from the source
    if batches is not None and forward != dtype:  # say what the layer walk computes in, and why
        calibration += (f", {str(forward).removeprefix('torch.')} forwards ("
                        + ("no native bf16 dot products on this CPU" if dtype == torch.bfloat16 else "no fast fp16 GEMM on CPUs") + ")")
    timings["load"] = round(time.perf_counter() - start, 3)

    start = time.perf_counter()
    with ui.step("hashing source weights"):
        files = [resolved.source_file] if resolved.source_file else weight_files(resolved.path)
        digest = source_hash(files)
    timings["hash"] = round(time.perf_counter() - start, 3)

    start = time.perf_counter()
    quantized: set[str] = set()
    expert_tokens: dict[str, list[int]] = {}
    with atomic_dir(out, force) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for key in model.state_dict():  # embeddings, final norm, untied lm_head: from the source, dense or int8 rows
            if key.startswith("model.layers.") or (key == "lm_head.weight" and config.get("tie_word_embeddings")):
                continue
            if (module := key.removesuffix(".weight")) in tables:
                for name, tensor in compressed_tensors_of(module, rtn(source.get(key).float(), tables[module], dtype)).items():
                    writer.add(name, tensor)
                quantized.add(module)
            else:
                writer.add(key, source.get(key).to(dtype))
        label = f"quantizing ({recipe.method}" + (", a mix)" if mix else f", int{recipe.bits})" if recipe.scheme() else ")")
        with ui.bar(label, len(layers)) as advance:
            for i, layer, result in walk(
                layers, by_layer(targets, len(layers)), batches, recipe, dtype, arch,
                load=lambda i, layer: load_layer(layer, f"model.layers.{i}", source, device, arch),
                release=release_layer,
            ):
                write_layer(writer, layer, f"model.layers.{i}", result, recipe, dtype, arch)
                quantized |= set(result.qweights)
                if result.expert_tokens is not None:
                    expert_tokens[f"model.layers.{i}"] = result.expert_tokens
                    if note := few_tokens_note(f"model.layers.{i}", result.expert_tokens):
                        notes.append(note)
                        ui.note(note)
                del result  # written: its integers need not outlive the next layer's solve
                advance()
        timings["quantize"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        with ui.step("writing the checkpoint"):
            names = writer.finish()
            kv = recipe.kv_strategy if recipe.kv_cache else None
            actorder = recipe.actorder if recipe.method == "gptq" else None
            ignore = dense_ignore(model, recipe.ignore, quantized) + routers(layers, "model.layers", arch)
            qconfig = quantization_config(recipe.scheme(), ignore, kv, actorder, mix, tables)
            write_metadata(tmp, model.config, _generation_config(resolved.path), tokenizer, qconfig, dtype)
            timings["save"] = round(time.perf_counter() - start, 3)
            write_manifest(tmp, {
                "quantkit_version": quantkit.__version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "recipe": recipe.to_dict(),
                "calibration": calibration,
                "source": {"model": spec, "kind": resolved.kind, "files": [f.name for f in files], "sha256": digest},
                "timings_s": dict(timings),
                "notes": notes,
                **({"expert_tokens": expert_tokens} if expert_tokens else {}),
            })
    params = source.parameters(bool(config.get("tie_word_embeddings")))
    return QuantizeResult(
        out=out,
        recipe=recipe,
        quantized_modules=len(quantized),
        dense_bytes=params * 2,
        out_bytes=sum((out / n).stat().st_size for n in names),
        files=names,
        timings_s=timings,
        peak_rss_bytes=peak_rss_bytes(),
        calibration=calibration,
        notes=notes,
        expert_tokens=expert_tokens,
    )


def _generation_config(path: Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def quantize_loaded(model: nn.Module, recipe: Recipe, scale_dtype: torch.dtype, calib_ids: torch.Tensor | None = None) -> dict[str, LayerResult]:
    """Quantize a model already in memory, in place: its Linears become their fake-quantized values.

    The same walk as `run_quantize`, without disk; the reference the tests hold checkpoints against.
    """
    layers = decoder_layers(model)
    arch = arch_of(model.config.to_dict())
    targets = find_targets(layers, "model.layers", recipe.ignore, arch) if recipe.scheme() else []
    resolve_group_size(recipe, targets)
    batches = None
    if recipe.needs_calibration:
        if calib_ids is None:
            raise QuantkitError(f"method {recipe.method} needs calibration rows")
        device = next(model.parameters()).device.type
        batches = first_layer_inputs(model, layers, calib_ids, CALIB_BATCH, device)
    return {f"model.layers.{i}": r for i, _, r in walk(layers, by_layer(targets, len(layers)), batches, recipe, scale_dtype, arch)}
