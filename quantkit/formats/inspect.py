"""What a checkpoint holds, read from config.json and the safetensors headers (no weights are loaded)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit import QuantkitError
from quantkit.config import EMBED, HEAD, KERNEL_BITS
from quantkit.formats.load import (
    PACKED,
    quant_config_of,
    read_header,
    read_tensors,
    safetensors_files,
    scheme_for,
)

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "BOOL": 1}
LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


@dataclass(slots=True)
class ModuleRow:
    """Weights that share a role across layers, e.g. `model.layers.*.self_attn.q_proj`."""

    name: str
    count: int
    shape: list[int]
    storage: str  # "int4 g64 sym" | "bf16"


@dataclass(slots=True)
class Inspection:
    path: str
    architecture: str
    model_type: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    dtype: str
    quant_method: str | None
    quant_format: str | None
    config_groups: dict[str, Any]
    ignore: list[str]
    kv_cache_scheme: dict[str, Any] | None
    parameters: int
    quantized_parameters: int
    bytes_on_disk: int
    dense_fp16_bytes: int
    weight_memory_bytes: int  # as loaded (5/6-bit values unpacked to int8); kernels may repack (bf16 copies of grouped int8)
    modules: list[ModuleRow] = field(default_factory=list)
    linear_bits: float = 0.0  # average bits per decoder-layer Linear weight, scales and zero points included
    mix: dict[str, int] = field(default_factory=dict)  # storage label -> decoder-layer Linears stored so (a budget's mix)
    per_layer: list[dict[str, str]] = field(default_factory=list)  # with a mix: per layer, Linear -> storage label
    method: str | None = None  # from quantkit.json, when quantkit wrote it
    tables: dict[str, str] = field(default_factory=dict)  # the embedding and head -> storage ("tied" for a tied head)

    @property
    def ratio(self) -> float:
        return self.dense_fp16_bytes / max(self.bytes_on_disk, 1)

    @property
    def kept_dense(self) -> list[str]:
        """The config's `ignore` less a tied head whose table is quantized: it is ignored as a Linear and read as
        the embedding's int8 rows."""
        quantized = self.tables.get(HEAD) == "tied" and self.tables.get(EMBED, "").startswith("int")
        return [m for m in self.ignore if not (quantized and m == HEAD)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compression_vs_fp16"] = round(self.ratio, 3)
        return d


def storage_label(scheme) -> str:
    group = "channel" if scheme.group_size is None else f"g{scheme.group_size}"
    return f"int{scheme.bits} {group} {'sym' if scheme.symmetric else 'asym'}"


def inspect_checkpoint(path: Path) -> Inspection:
    config = json.loads((path / "config.json").read_text())
    qc = quant_config_of(path) or {}
    if qc and qc.get("quant_method") != "compressed-tensors":
        raise QuantkitError(f"{path} is quantized with {qc.get('quant_method')!r}; quantkit inspects compressed-tensors checkpoints")
    files = safetensors_files(path)
    headers = {}
    for f in files:
        headers.update(read_header(f))
    shapes = read_tensors(path, [k for k in headers if k.endswith(".weight_shape")])
    params = qparams = tensor_bytes = memory_bytes = linear_params = linear_bytes = 0
    rows: dict[tuple[str, str], ModuleRow] = {}
    mix: dict[str, int] = {}
    per_layer: dict[int, dict[str, str]] = {}
    tables: dict[str, str] = {}
    for key, h in headers.items():
        nbytes = math.prod(h["shape"]) * DTYPE_BYTES.get(h["dtype"], 2)
        tensor_bytes += nbytes
        if LAYER_INDEX.search(key) and (key.endswith(PACKED) or re.search(r"\.weight_(scale|zero_point)$", key)
                                        or (key.endswith(".weight") and len(h["shape"]) == 2)):
            linear_bytes += nbytes  # a decoder Linear's stored bytes
        if key.endswith(PACKED):
            module = key.removesuffix(PACKED)
            shape = [int(x) for x in shapes[f"{module}.weight_shape"]]
            scheme = scheme_for(module, qc)
            n, label = math.prod(shape), storage_label(scheme)
            qparams += n
            if scheme.bits not in KERNEL_BITS:  # the runtime holds 5/6-bit values as int8
                memory_bytes += n - nbytes
        elif re.search(r"\.weight_(shape|scale|zero_point)$", key) or key.endswith(("k_scale", "v_scale")):
            continue
        else:
            module, shape, n, label = key, h["shape"], math.prod(h["shape"]), h["dtype"].lower()
        params += n
        if LAYER_INDEX.search(module) and len(shape) == 2:
            linear_params += n
            mix[label] = mix.get(label, 0) + 1
            layer, sub = re.match(r".*?\.layers\.(\d+)\.(.+?)(?:\.weight)?$", module).groups()
            per_layer.setdefault(int(layer), {})[sub] = label
        if (table := module.removesuffix(".weight")) in (EMBED, HEAD):
            tables[table] = label
        role = LAYER_INDEX.sub(".layers.*.", module)
        row = rows.setdefault((role, label), ModuleRow(role, 0, shape, label))
        row.count += 1
    return Inspection(
        path=str(path),
        architecture=(config.get("architectures") or ["?"])[0],
        model_type=config.get("model_type", "?"),
        layers=int(config.get("num_hidden_layers", 0)),
        hidden_size=int(config.get("hidden_size", 0)),
        heads=int(config.get("num_attention_heads", 0)),
        kv_heads=int(config.get("num_key_value_heads", config.get("num_attention_heads", 0))),
        vocab_size=int(config.get("vocab_size", 0)),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "?"),
        quant_method=qc.get("quant_method"),
        quant_format=qc.get("format"),
        config_groups=qc.get("config_groups", {}),
        ignore=qc.get("ignore", []),
        kv_cache_scheme=qc.get("kv_cache_scheme"),
        parameters=params,
        quantized_parameters=qparams,
        bytes_on_disk=sum(f.stat().st_size for f in files),
        dense_fp16_bytes=params * 2,
        weight_memory_bytes=tensor_bytes + memory_bytes,
        modules=list(rows.values()),
        linear_bits=8 * linear_bytes / max(linear_params, 1),
        mix=mix,
        per_layer=[per_layer[i] for i in sorted(per_layer)] if len(mix) > 1 else [],
        method=_method(path),
        tables={**tables, **({HEAD: "tied"} if HEAD not in tables and EMBED in tables else {})},
    )


def _method(path: Path) -> str | None:
    try:
        return json.loads((path / "quantkit.json").read_text())["recipe"]["method"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
