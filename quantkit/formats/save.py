"""Write a compressed-tensors `pack-quantized` checkpoint that vLLM and HF transformers load unchanged.

The directory is built in a hidden temporary sibling and renamed into place only when complete, so an
interrupted or failed run never leaves something at OUT that looks like a checkpoint.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import compressed_tensors
import torch
from torch import Tensor

from quantkit import QuantkitError
from quantkit.config import Scheme
from quantkit.formats.pack import pack_int32
from quantkit.formats.safetensors_file import ST_NAMES, header_bytes
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


def kv_cache_args(strategy: str) -> dict[str, Any]:
    """`kv_cache_scheme`: static symmetric FP8 per tensor, or per KV head ("attn_head")."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "tensor" if strategy == "tensor" else "attn_head",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(
    scheme: Scheme | None, ignore: list[str], kv_strategy: str | None = None, actorder: str | None = None,
    mix: dict[str, Scheme] | None = None, tables: dict[str, Scheme] | None = None,
) -> dict[str, Any]:
    """config.json `quantization_config`: integer weights on Linear layers (scheme None: weights dense) and, with
    `kv_strategy`, a static FP8 KV cache. `mix` (module name -> scheme, a budget's choice): one config group per
    scheme, its `targets` the exact module names, instead of one group on every Linear. `tables`: the quantized
    vocabulary tables, by exact name (an exact name outranks the class name "Linear" in compressed-tensors and vLLM)."""
    targets = {scheme: ["Linear"]} if scheme is not None and mix is None else {}
    for name, s in sorted({**(mix or {}), **(tables or {})}.items()):
        targets.setdefault(s, []).append(name)
    groups = {}
    for i, (s, names) in enumerate(sorted(targets.items(), key=lambda kv: (kv[0].bits, kv[0].group_size or 1 << 30))):
        weights = weights_args(s)
        weights["actorder"] = actorder
        groups[f"group_{i}"] = {
            "targets": names,
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if groups else "dense",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore if groups else [],
        "kv_cache_scheme": kv_cache_args(kv_strategy) if kv_strategy else None,
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


class ShardWriter:
    """Streams tensors into safetensors shards of at most `max_bytes`, holding none of them in memory.

    Tensor bytes go straight to a data file as they arrive; when a shard fills, its header is written
    and the data appended after it. Shards are renamed to `model-0000N-of-0000M.safetensors` at `finish`,
    when M is known; a single shard becomes `model.safetensors`.
    """

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.header: dict[str, Any] = {}
        self.data = None  # open file of the current shard's tensor bytes
        self.size = 0
        self.parts: list[tuple[Path, list[str], int]] = []

    def add(self, name: str, tensor: Tensor) -> None:
        t = tensor.detach().to("cpu")
        self.add_blocks(name, t.dtype, tuple(t.shape), [t])

    def add_blocks(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], blocks: Iterable[Tensor]) -> None:
        """One tensor of `shape` whose row-major bytes arrive in consecutive blocks (a big tensor built piece by
        piece never exists whole in memory)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.header and self.size + nbytes > self.max_bytes:
            self._close()
        if self.data is None:
            self.data = open(self.out / f".part-{len(self.parts):05d}.data", "wb")
        written = 0
        for block in blocks:
            b = block.detach().to("cpu", dtype).contiguous()
            if b.numel():
                self.data.write(b.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes: no copy (an embedding is 0.5 GB)
            written += b.numel() * b.element_size()
        if written != nbytes:
            raise ValueError(f"tensor {name}: blocks held {written} bytes, its shape {list(shape)} needs {nbytes}")
        self.header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [self.size, self.size + nbytes]}
        self.size += nbytes

    def _close(self) -> None:
        if self.data is None:
            self.data = open(self.out / f".part-{len(self.parts):05d}.data", "wb")
        data_path = Path(self.data.name)
        self.data.close()
        part = self.out / f".part-{len(self.parts):05d}.safetensors"
        with open(part, "wb") as f, open(data_path, "rb") as data:
            f.write(header_bytes(self.header))
            shutil.copyfileobj(data, f, 1 << 22)
        data_path.unlink()
        self.parts.append((part, list(self.header), self.size))
        self.header, self.data, self.size = {}, None, 0

    def finish(self) -> list[str]:
        if self.header or not self.parts:
            self._close()
        n = len(self.parts)
        names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (part, keys, _), name in zip(self.parts, names):
            part.rename(self.out / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": sum(b for *_, b in self.parts)}, "weight_map": weight_map}
            (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return names


def atomic_file(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary sibling, then rename it over `path`: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    tmp.replace(path)


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


def write_metadata(out: Path, config, generation_config, tokenizer, quant_config: dict[str, Any], dtype: torch.dtype) -> None:
    """config.json (with `quantization_config` and the checkpoint's dtype), generation config, tokenizer."""
    config = copy.deepcopy(config)
    config.quantization_config = quant_config
    config.use_cache = True
    config.dtype = dtype
    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
