"""Read compressed-tensors checkpoints: their config, their tensors, and dense weights dequantized from them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from quantkit import QuantkitError
from quantkit.config import Scheme
from quantkit.formats.pack import unpack_int32
from quantkit.quant.qparams import dequantize

PACKED = ".weight_packed"


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuantkitError(f"no .safetensors files in {path}")
    return files


def read_header(file: Path) -> dict[str, Any]:
    """The safetensors JSON header (names, dtypes, shapes, offsets) without reading any tensor data."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100_000_000 or n + 8 > file.stat().st_size:
                raise ValueError("header length out of range")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise QuantkitError(f"corrupt safetensors file {file}: {e}") from e
    header.pop("__metadata__", None)
    return header


def read_tensors(path: Path, names: list[str] | None = None) -> dict[str, Tensor]:
    """Load tensors from every shard (all, or only `names`); a damaged file is one clear error."""
    wanted = set(names) if names is not None else None
    tensors: dict[str, Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if wanted is None or key in wanted:
                        tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise QuantkitError(f"corrupt safetensors file {file}: {str(e).splitlines()[0]}") from e
    return tensors


def quant_config_of(path: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QuantkitError(f"cannot read {path / 'config.json'}: {e}") from e
    return config.get("quantization_config")


def scheme_for(module: str, quant_config: dict[str, Any]) -> Scheme:
    """The weight scheme of the config group whose targets match this packed module, as compressed-tensors and vLLM
    rank them: an exact name first, then a `re:` pattern, then the class name."""
    found = []
    for group in quant_config.get("config_groups", {}).values():
        ranks = [r for t in group.get("targets", []) if (r := _target_rank(module, t)) is not None]
        if ranks:
            found.append((min(ranks), len(found), group["weights"]))
    if not found:
        raise QuantkitError(f"checkpoint has packed weights for {module} but no config group targets it")
    w = min(found)[2]
    group_size = w.get("group_size") if w.get("strategy") == "group" else None
    return Scheme(bits=int(w["num_bits"]), group_size=group_size, symmetric=bool(w.get("symmetric", True)))


def _target_rank(module: str, target: str) -> int | None:
    """0: the exact name, 1: a matching `re:` pattern, 2: the class (Linear; Embedding for the embedding table)."""
    if target == module:
        return 0
    if target.startswith("re:"):
        return 1 if re.match(target[3:], module) else None
    is_embedding = module.endswith("embed_tokens")
    return 2 if target == ("Embedding" if is_embedding else "Linear") else None


def packed_module(tensors: dict[str, Tensor], module: str, scheme: Scheme) -> tuple[Tensor, int, Tensor, Tensor | None]:
    """(words int32 [out, in * bits / 32] as stored, in_features, scale [out, groups], zero_point int8 [out, groups]
    or None) of a packed module."""
    out_features, in_features = (int(x) for x in tensors[f"{module}.weight_shape"])
    zp_packed = tensors.get(f"{module}.weight_zero_point")
    zp = None if zp_packed is None else unpack_int32(zp_packed, scheme.bits, out_features, dim=0)
    return tensors[module + PACKED], in_features, tensors[f"{module}.weight_scale"], zp


def unpacked_module(tensors: dict[str, Tensor], module: str, scheme: Scheme) -> tuple[Tensor, Tensor, Tensor | None]:
    """(q int8 [out, in], scale [out, groups], zero_point int8 [out, groups] or None) of a packed module."""
    words, in_features, scale, zp = packed_module(tensors, module, scheme)
    return unpack_int32(words, scheme.bits, in_features, dim=1), scale, zp


def dequantize_module(tensors: dict[str, Tensor], module: str, scheme: Scheme, dtype: torch.dtype | None = None) -> Tensor:
    """Dense weight [out, in] from `module.weight_packed` / `_scale` / `_zero_point`, rounded once to `dtype`
    (default: the scale's dtype)."""
    q, scale, zp = unpacked_module(tensors, module, scheme)
    return dequantize(q, scale, zp).to(dtype or scale.dtype)


def dense_state_dict(path: Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, with packed weights replaced by their dequantized `weight`.

    With `dtype`, every floating tensor comes in that dtype (packed weights rounded once, from float32)."""
    tensors = read_tensors(path)
    quant_config = quant_config_of(path) or {}
    out: dict[str, Tensor] = {}
    for key, value in tensors.items():
        if key.endswith(PACKED):
            module = key.removesuffix(PACKED)
            out[f"{module}.weight"] = dequantize_module(tensors, module, scheme_for(module, quant_config), dtype)
        elif not re.search(r"\.weight_(shape|scale|zero_point)$", key):
            out[key] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    return out


def load_dequantized_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An HF model whose weights are dequantized from our checkpoint: quantkit's own reading of it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    from quantkit.arch import arch_of
    from quantkit.models import checkpoint_parts

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dense_state_dict(path, dtype)
    arch, missing = arch_of(config.to_dict(), path), []
    with torch.no_grad():
        for key, tensor in model.state_dict().items():  # HF's names; a layer's as the checkpoint names them (experts)
            layer = re.match(r"(model\.layers\.\d+)\.(.+)", key)
            parts = checkpoint_parts(layer[2], tensor, arch) if layer else [(key, tensor)]
            for name, part in parts:
                name = f"{layer[1]}.{name}" if layer else name
                if name in state:
                    part.copy_(state.pop(name))
                elif not (name == "lm_head.weight" and config.tie_word_embeddings):
                    missing.append(name)
    unexpected = list(state)
    if missing or unexpected:
        raise QuantkitError(f"checkpoint {path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsSource:
    """Random access to a checkpoint's tensors by name, one at a time, without loading the rest.

    This is what lets quantization walk a model larger than memory: only the tensors asked for are read,
    with plain reads rather than a memory map, so bytes already used do not stay resident.
    """

    def __init__(self, path: Path):
        self.path = path
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, list[int]] = {}
        self.entries: dict[str, tuple[str, int, int]] = {}  # name -> dtype, absolute start, end
        for file in safetensors_files(path):
            with open(file, "rb") as f:
                base = 8 + int.from_bytes(f.read(8), "little")
            for key, info in read_header(file).items():
                self.files[key] = file
                self.shapes[key] = info["shape"]
                start, end = info["data_offsets"]
                self.entries[key] = (info["dtype"], base + start, base + end)

    def parameters(self, tied: bool) -> int:
        """Parameter count of the dense checkpoint (a tied lm_head counts once)."""
        return sum(math.prod(s) for k, s in self.shapes.items() if not (tied and k == "lm_head.weight"))

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> Tensor:
        file = self.files.get(name)
        if file is None:
            raise QuantkitError(f"tensor {name} is missing from the checkpoint at {self.path}")
        dtype, start, end = self.entries[name]
        shape = self.shapes[name]
        if dtype not in ST_DTYPES:
            raise QuantkitError(f"tensor {name} in {file} has dtype {dtype}, which quantkit does not read")
        want = math.prod(shape) * torch.empty(0, dtype=ST_DTYPES[dtype]).element_size()
        buf = bytearray(end - start)
        try:
            with open(file, "rb") as f:
                f.seek(start)
                n = f.readinto(buf)
        except OSError as e:
            raise QuantkitError(f"cannot read {file}: {e}") from e
        if n != len(buf) or len(buf) != want:
            raise QuantkitError(f"corrupt safetensors file {file}: tensor {name} is truncated or mis-sized")
        if not buf:
            return torch.empty(shape, dtype=ST_DTYPES[dtype])
        return torch.frombuffer(buf, dtype=ST_DTYPES[dtype]).reshape(shape)
