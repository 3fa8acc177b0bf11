"""Quantize a model's decoder-layer Linears in place, one layer at a time.

Each targeted weight is replaced by its fake-quantized value (exactly what a consumer will dequantize
from the checkpoint), and the integer form is returned for the exporter to pack once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit import QuantkitError
from quantkit.config import DEFAULT_GROUP_4BIT, FALLBACK_GROUPS, Recipe
from quantkit.quant.qparams import QuantizedWeight
from quantkit.quant.rtn import rtn


@dataclass(slots=True)
class Target:
    """One Linear to quantize: `name` is its full module path (the checkpoint key prefix)."""

    layer: int
    name: str
    module: nn.Linear


def matches(name: str, module: nn.Module, pattern: str) -> bool:
    """compressed-tensors target semantics: exact module name, class name, or `re:` regex on the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__


def find_targets(layers: nn.ModuleList, prefix: str, ignore: list[str]) -> list[Target]:
    """Every nn.Linear inside the decoder layers that no ignore pattern matches, in layer order."""
    found = []
    for i, layer in enumerate(layers):
        for sub, module in layer.named_modules():
            name = f"{prefix}.{i}.{sub}"
            if isinstance(module, nn.Linear) and not any(matches(name, module, p) for p in ignore):
                found.append(Target(i, name, module))
    return found


def resolve_group_size(recipe: Recipe, targets: list[Target]) -> str | None:
    """Fix recipe.group_size against the real widths; returns a one-line note when it had to change.

    The 4-bit default of 128 falls back to the largest of 64 and 32 that divides every width (small
    models such as SmolLM2-135M are 576 wide). A size the user chose that does not divide is an error.
    """
    if recipe.group_size is None or not targets:
        return None
    bad = [t for t in targets if t.module.in_features % recipe.group_size]
    if not bad:
        return None
    if recipe.group_size_explicit or recipe.group_size != DEFAULT_GROUP_4BIT:
        t = bad[0]
        raise QuantkitError(
            f"group size {recipe.group_size} does not divide the input width {t.module.in_features} of {t.name}"
        )
    for size in FALLBACK_GROUPS:
        if all(t.module.in_features % size == 0 for t in targets):
            widths = sorted({t.module.in_features for t in bad})
            recipe.group_size = size
            return f"group size {DEFAULT_GROUP_4BIT} does not divide input width {widths[0]}; using group size {size}"
    raise QuantkitError(
        f"no group size among {DEFAULT_GROUP_4BIT}, {', '.join(map(str, FALLBACK_GROUPS))} divides the input "
        f"width {bad[0].module.in_features} of {bad[0].name}; pass --group-size -1 for per-channel scales"
    )


@torch.no_grad()
def quantize_model(
    targets: list[Target],
    recipe: Recipe,
    scale_dtype: torch.dtype,
    on_layer: Callable[[int], None] | None = None,
) -> dict[str, QuantizedWeight]:
    """RTN every target, layer by layer; weights become their fake-quantized values in place."""
    scheme = recipe.scheme()
    out: dict[str, QuantizedWeight] = {}
    last_layer = None
    for t in targets:
        if on_layer and last_layer is not None and t.layer != last_layer:
            on_layer(last_layer)
        last_layer = t.layer
        qw = rtn(t.module.weight, scheme, scale_dtype)
        t.module.weight.copy_(qw.dequantize(t.module.weight.dtype))
        out[t.name] = qw
    if on_layer and last_layer is not None:
        on_layer(last_layer)
    return out
