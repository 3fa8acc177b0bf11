"""Which Linears to quantize, and with what group size: decided once, before any layer is touched."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from quantkit import QuantkitError
from quantkit.config import DEFAULT_GROUP_4BIT, FALLBACK_GROUPS, Recipe


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
