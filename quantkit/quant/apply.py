"""Which Linears to quantize, and with what group size: decided once, before any layer is touched."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor, nn

from quantkit import QuantkitError
from quantkit.arch import LLAMA, SHARED, Arch
from quantkit.config import DEFAULT_GROUP_4BIT, EMBED, FALLBACK_GROUPS, HEAD, TABLE_SCHEMES, Recipe, Scheme


@dataclass(slots=True)
class ExpertProj:
    """One expert's Linear inside HF's fused expert parameters (see models.checkpoint_parts): `weight` is a view,
    taken afresh at each use (the layer is materialized after its targets are found), so writing it writes the model."""

    experts: nn.Module  # the block's `experts`, holding gate_up_proj [E, 2 * inter, hidden] and down_proj [E, hidden, inter]
    index: int
    which: int  # 0 gate, 1 up, 2 down

    @property
    def weight(self) -> Tensor:  # [out, in]
        from quantkit.models import expert_slice

        fused = self.experts.down_proj if self.which == 2 else self.experts.gate_up_proj
        return expert_slice(fused, self.index, self.which)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclass(slots=True)
class Target:
    """One Linear to quantize: `name` is its full module path (the checkpoint key prefix)."""

    layer: int
    name: str
    module: nn.Linear | ExpertProj
    scheme: Scheme | None = None  # this Linear's own scheme (a budget's mix); None: the recipe's


def matches(name: str, module: nn.Module, pattern: str) -> bool:
    """compressed-tensors target semantics: exact module name, class name, or `re:` regex on the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == type(module).__name__


def find_targets(layers: nn.ModuleList, prefix: str, ignore: list[str], arch: Arch = LLAMA) -> list[Target]:
    """Every nn.Linear inside the decoder layers and every expert's Linear that no ignore pattern matches, in layer
    order. Routers stay dense: a sparse block's `gate` (not a Linear in HF) and the shared expert's gate."""
    found = []
    for i, layer in enumerate(layers):
        candidates = [(f"{prefix}.{i}.{sub}", m) for sub, m in layer.named_modules()
                      if isinstance(m, nn.Linear) and not sub.endswith(f"{SHARED}_gate")]
        experts = getattr(layer.mlp, "experts", None)
        if arch.moe is not None and experts is not None:
            candidates += [(f"{prefix}.{i}.{arch.moe.expert(e, j)}", ExpertProj(experts, e, j))
                           for e in range(experts.gate_up_proj.shape[0]) for j in range(3)]
        found += [Target(i, name, m) for name, m in candidates if not any(matches(name, m, p) for p in ignore)]
    return found


def routers(layers: nn.ModuleList, prefix: str, arch: Arch) -> list[str]:
    """The sparse blocks' routers as the checkpoint names them: dense, and in `ignore` (vLLM builds them as Linears)."""
    if arch.moe is None:
        return []
    return [f"{prefix}.{i}.{arch.moe.block}.gate" for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]


def vocab_tables(config: dict, recipe: Recipe, mix: dict[str, Scheme] | None = None) -> dict[str, Scheme]:
    """The vocabulary tables to quantize (int8 per row or per 32 values, round-to-nearest: at 8 bits GPTQ would gain little), by
    module name: the embedding, and the head when it is not tied to it (a tied head reads the embedding's int8 rows).
    A budget's mix names them itself; otherwise `recipe.embeddings` (w8: both; head: an untied head alone, the one
    table HF transformers and vLLM read as int8 too, and a large share of a decode step's reads; dense: none)."""
    if mix is not None:
        return {n: s for n, s in mix.items() if n in (EMBED, HEAD)}
    tied = bool(config.get("tie_word_embeddings"))
    if recipe.embeddings == "head" and tied:
        raise QuantkitError("--embeddings head quantizes an untied lm_head; this model's head is its embedding (tied): "
                            "use --embeddings w8, or `--lm-head int8` when serving")
    names = ([EMBED] + ([] if tied else [HEAD]) if recipe.embeddings in TABLE_SCHEMES
             else [HEAD] if recipe.embeddings == "head" else [])
    scheme = TABLE_SCHEMES.get(recipe.embeddings, TABLE_SCHEMES["w8"])  # (head: int8 rows)
    if names and scheme.group_size and int(config.get("hidden_size") or 0) % scheme.group_size:
        raise QuantkitError(f"--embeddings {recipe.embeddings} needs a hidden size divisible by {scheme.group_size}; this "
                            f"model's is {config.get('hidden_size')}: use --embeddings w8 (one scale per row)")
    return dict.fromkeys(names, scheme)


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
