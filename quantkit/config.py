"""What to quantize and how: the Scheme of one weight group, the Recipe of a whole run, and YAML presets.

A recipe file holds the same fields as the `quantize` flags; flags given on the command line override it.
Every field is validated here, with errors that name the file and the field, so nothing downstream has
to second-guess its input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from quantkit import QuantkitError

METHODS = ("rtn", "gptq", "awq", "none", "bnb-nf4", "bnb-int8")
CALIBRATED = ("gptq", "awq")
KV_STRATEGIES = ("tensor", "head")
DTYPES = ("bf16", "fp16")
DEFAULT_GROUP_4BIT = 128  # (also 5 and 6 bits)
# 4 and 8 run on every engine; 5 and 6 (compressed-tensors packs them densely) load in HF transformers, run in
# quantkit's runtime as int8 values and in vLLM only through its Humming kernels (CUDA)
WEIGHT_BITS = (4, 5, 6, 8)
KERNEL_BITS = (4, 8)  # read by every engine's kernels as stored; quantkit's runtime unpacks the others to int8
FALLBACK_GROUPS = (64, 32)


@dataclass(slots=True, frozen=True)
class Scheme:
    """Integer weight quantization of one Linear: `group_size` None means one scale per output channel."""

    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1


EMBEDDINGS = ("dense", "w8", "w8g32", "head", "auto")
EMBED, HEAD = "model.embed_tokens", "lm_head"  # the vocabulary tables, as the checkpoint names them
TABLE_SCHEMES = {"w8": Scheme(bits=8, group_size=None, symmetric=True),  # a quantized vocabulary table: int8, one scale
                 "w8g32": Scheme(bits=8, group_size=32, symmetric=True)}  # per row, or one per 32 values of a row


@dataclass(slots=True)
class Recipe:
    """One quantization run. `group_size` None = per channel; unset fields take defaults by bit width."""

    name: str = "custom"
    method: str = "rtn"
    bits: int = 4
    group_size: int | None = None
    group_size_explicit: bool = False
    symmetric: bool = True
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    dtype: str | None = None
    kv_cache: str | None = None  # "fp8": static FP8 KV-cache scales from calibration
    kv_strategy: str = "tensor"  # "tensor" | "head"
    actorder: str | None = "static"  # GPTQ column order: "static" (by Hessian diagonal) or None
    damp: float = 0.01  # GPTQ: fraction of the mean Hessian diagonal added before inverting
    block_size: int = 128  # GPTQ: columns updated together
    true_sequential: bool = True  # GPTQ: each sublayer's Hessian from the quantized sublayers before it
    embeddings: str = "dense"  # the vocabulary tables: "dense", "w8" (both int8 per row), "w8g32" (both int8, a scale per
    # 32 values), "head" (an untied head only, int8 per row), "auto" (a budget decides)

    def scheme(self) -> Scheme | None:
        """The weight scheme, or None when weights stay dense (method none)."""
        if self.method == "none":
            return None
        return Scheme(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric)

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATED or self.kv_cache is not None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("group_size_explicit")
        return d


# Fields a recipe file (and the command line) may set, with their checks.
RECIPE_FIELDS = ("name", "method", "bits", "group_size", "symmetric", "ignore", "dtype", "kv_cache", "kv_strategy",
                 "actorder", "damp", "block_size", "true_sequential", "embeddings")


def _bad(where: str, name: str, msg: str) -> QuantkitError:
    if where == "option":
        flag = "--asym/--sym" if name == "symmetric" else f"--{name.replace('_', '-')}"
        return QuantkitError(f"{flag} {msg}")
    return QuantkitError(f"{where}: field '{name}' {msg}")


def validate_field(name: str, value: Any, where: str) -> Any:
    """Check one recipe field and return its normalized value; `where` names the source in errors."""
    if name == "name":
        if not isinstance(value, str) or not value:
            raise _bad(where, name, "must be a non-empty string")
        return value
    if name == "method":
        if value not in METHODS:
            raise _bad(where, name, f"must be one of {', '.join(METHODS)}, got {value!r}")
        return value
    if name == "bits":
        if isinstance(value, bool) or value not in WEIGHT_BITS:
            raise _bad(where, name, f"must be 4, 5, 6 or 8, got {value!r}")
        return int(value)
    if name == "group_size":
        if value is None or value == -1 or value == "channel":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8:
            raise _bad(where, name, f"must be a positive multiple of 8, or -1 for per-channel, got {value!r}")
        return value
    if name in ("symmetric", "true_sequential"):
        if not isinstance(value, bool):
            raise _bad(where, name, f"must be true or false, got {value!r}")
        return value
    if name == "ignore":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise _bad(where, name, "must be a list of module names or 're:' patterns")
        return list(value)
    if name == "dtype":
        if value not in DTYPES:
            raise _bad(where, name, f"must be one of {', '.join(DTYPES)}, got {value!r}")
        return value
    if name == "kv_cache":
        if value not in (None, "fp8", "none"):
            raise _bad(where, name, f"must be fp8 or none, got {value!r}")
        return None if value == "none" else value
    if name == "kv_strategy":
        if value not in KV_STRATEGIES:
            raise _bad(where, name, f"must be one of {', '.join(KV_STRATEGIES)}, got {value!r}")
        return value
    if name == "actorder":
        if value in (None, False, "none"):
            return None
        if value not in ("static", True):
            raise _bad(where, name, f"must be static or none, got {value!r}")
        return "static"
    if name == "damp":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise _bad(where, name, f"must be a number between 0 and 1, got {value!r}")
        return float(value)
    if name == "block_size":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(where, name, f"must be a positive integer, got {value!r}")
        return value
    if name == "embeddings":
        if value not in EMBEDDINGS:
            raise _bad(where, name, f"must be one of {', '.join(EMBEDDINGS)}, got {value!r}")
        return value
    raise QuantkitError(f"{where}: unknown field '{name}' (known: {', '.join(RECIPE_FIELDS)})")


def bundled_recipes_dir() -> Path:
    """Recipes ship inside the wheel; in a source checkout they are the repo's `recipes/` folder."""
    here = Path(__file__).resolve().parent
    installed = here / "_bundled" / "recipes"
    return installed if installed.is_dir() else here.parent / "recipes"


def bundled_recipe_names() -> list[str]:
    d = bundled_recipes_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def read_recipe_file(spec: str) -> dict[str, Any]:
    """Read a recipe by path or by bundled name (`w4a16_rtn_g128`) and validate every field."""
    path = Path(spec)
    if not path.is_file():
        candidate = bundled_recipes_dir() / f"{spec.removesuffix('.yaml')}.yaml"
        if not candidate.is_file():
            names = ", ".join(bundled_recipe_names()) or "none"
            raise QuantkitError(f"recipe '{spec}' not found: give a YAML file or a bundled name ({names})")
        path = candidate
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise QuantkitError(f"recipe {path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise QuantkitError(f"recipe {path}: must be a mapping of fields, got {type(data).__name__}")
    where = f"recipe {path.name}"
    fields = {k: validate_field(str(k), v, where) for k, v in data.items()}
    fields.setdefault("name", path.stem)
    return fields


def build_recipe(recipe_specs: list[str], overrides: dict[str, Any], extra_ignore: list[str] = ()) -> Recipe:
    """Later recipes override earlier ones; flags (`overrides`, None = not given) override all recipes.

    Ignore patterns add up instead: the recipes', then `extra_ignore` (--ignore); lm_head is always kept dense.
    """
    fields: dict[str, Any] = {}
    names = []
    for spec in recipe_specs:
        fields.update(read_recipe_file(spec))
        names.append(fields["name"])
    if names:
        fields["name"] = "+".join(names)
    for k, v in overrides.items():
        if v is not None:
            fields[k] = validate_field(k, v, "option")
    ignore = ["lm_head", *fields.pop("ignore", []), *validate_field("ignore", list(extra_ignore), "option")]
    fields["ignore"] = list(dict.fromkeys(ignore))
    recipe = Recipe(**{k: v for k, v in fields.items() if k != "group_size"})
    if "group_size" in fields:
        recipe.group_size = fields["group_size"]
        recipe.group_size_explicit = True
    elif recipe.bits < 8:
        recipe.group_size = DEFAULT_GROUP_4BIT
    return recipe
