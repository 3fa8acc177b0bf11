"""Write a compressed-tensors `pack-quantized` checkpoint that vLLM and HF transformers load unchanged.

The directory is built in a hidden temporary sibling and renamed into place only when complete, so an
interrupted or failed run never leaves something at OUT that looks like a checkpoint.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import compressed_tensors
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from quantkit import QuantkitError
from quantkit.config import Recipe, Scheme
from quantkit.formats.pack import pack_int32
from quantkit.quant.qparams import QuantizedWeight

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAME = "quantkit.json"


def weights_args(scheme: Scheme) -> dict[str, Any]:
    """The `weights` quantization args exactly as compressed-tensors serializes them."""
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": scheme.strategy,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict[str, Any]:
    """config.json `quantization_config` for weight-only integer quantization of Linear layers."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights_args(scheme),
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": compressed_tensors.__version__,
    }


def compressed_tensors_of(name: str, qw: QuantizedWeight) -> dict[str, Tensor]:
    """The tensors that replace `name.weight` on disk."""
    bits = qw.scheme.bits
    out = {
        f"{name}.weight_packed": pack_int32(qw.q, bits, dim=1),
        f"{name}.weight_scale": qw.scale.contiguous(),
        f"{name}.weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64),
    }
    if qw.zero_point is not None:
        out[f"{name}.weight_zero_point"] = pack_int32(qw.zero_point, bits, dim=0)
    return out


def checkpoint_tensors(model: nn.Module, qweights: dict[str, QuantizedWeight]) -> dict[str, Tensor]:
    """The model's state dict with each quantized weight swapped for its packed tensors, in model order."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue  # shares storage with the embedding; consumers re-tie it from config
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module in qweights:
            tensors.update(compressed_tensors_of(module, qweights[module]))
        else:
            tensors[key] = value.contiguous()
    return tensors


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise QuantkitError(f"--max-shard-size must look like 5GB, 500MB or 2GiB, got {text!r}")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        raise QuantkitError(f"--max-shard-size must be positive, got {text!r}")
    return size


def plan_shards(tensors: dict[str, Tensor], max_bytes: int) -> list[list[str]]:
    """Group tensor names into shards of at most max_bytes (a single larger tensor gets its own shard)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_shards(
    tensors: dict[str, Tensor], out: Path, max_bytes: int, on_shard: Callable[[int, int], None] | None = None
) -> list[str]:
    """Write safetensors shards (and the index when there is more than one); returns the file names."""
    shards = plan_shards(tensors, max_bytes)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, (fname, keys) in enumerate(zip(names, shards)):
        save_file({k: tensors[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
        if on_shard:
            on_shard(i + 1, n)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names


@contextmanager
def atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` only if the body finishes.

    With `force`, an existing `out` is moved aside first and deleted only after the new one is in place.
    """
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise QuantkitError(f"no space left on device while writing {out}; nothing was written") from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output(out: Path, force: bool) -> None:
    """Fail before any slow work when OUT exists (without --force) or is not a directory we may replace."""
    if out.exists() and not force:
        raise QuantkitError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise QuantkitError(f"{out} exists and is not a directory; refusing to replace it")


def save_checkpoint(
    out: Path,
    model: nn.Module,
    tokenizer,
    qweights: dict[str, QuantizedWeight],
    quant_config: dict[str, Any],
    manifest: dict[str, Any],
    max_shard_bytes: int,
    force: bool = False,
    on_shard: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write the whole checkpoint atomically; `manifest` (plus the save time) becomes quantkit.json."""
    start = time.perf_counter()
    with atomic_dir(out, force) as tmp:
        config = copy.deepcopy(model.config)
        config.quantization_config = quant_config
        config.save_pretrained(tmp)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        names = write_shards(checkpoint_tensors(model, qweights), tmp, max_shard_bytes, on_shard)
        manifest.setdefault("timings_s", {})["save"] = round(time.perf_counter() - start, 3)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return names
