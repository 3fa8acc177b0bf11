"""What a budget asks for, which precisions each unit may take, what each costs in bytes, and the cheapest mix.

A unit is the Linears that must share one scheme: a layer's q/k/v (the engines fuse them), its o, its gate/up, its
down. Each unit's choices are points (bytes, predicted KL); the mix is found greedily over each unit's lower convex
hull, taking the upgrades that remove the most predicted KL per byte first (under a byte limit, an upgrade that does
not fit is passed over and smaller ones of other units still taken). On the hulls that is optimal for the continuous
relaxation; the integer answer is within one unit's range (its smallest to largest choice) of the optimum.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit import QuantkitError
from quantkit.arch import Arch
from quantkit.config import DEFAULT_GROUP_4BIT, EMBED, FALLBACK_GROUPS, HEAD, TABLE_SCHEMES, Scheme
from quantkit.formats.save import parse_size

BUDGET_KINDS = ("kl", "bits", "size")


@dataclass(frozen=True, slots=True)
class Budget:
    kind: str  # "kl": mean KL (nats / token) on held-out rows; "bits": average bits per Linear weight; "size": bytes
    value: float

    def __str__(self) -> str:
        return f"{self.kind}={self.value:g}" if self.kind != "size" else f"size={self.value / 1e6:.0f}MB"


@dataclass(frozen=True, slots=True)
class Choice:
    label: str  # "w4g128", "w8", "dense"
    scheme: Scheme | None  # None: dense
    tables_only: bool = False  # added for the vocabulary tables (--embeddings auto), not one of the user's --choices


@dataclass(slots=True)
class Unit:
    name: str  # "model.layers.3.qkv"; "model.embed_tokens" (with a tied head) or "lm_head" for a vocabulary table
    layer: int  # -1 for a vocabulary table
    modules: list[str]  # full module names
    shapes: list[tuple[int, int]]  # [out, in] of each
    table: bool = False  # a vocabulary table: dense or int8 (per row or in groups), nothing else


def parse_budget(text: str) -> Budget:
    m = re.fullmatch(r"\s*(kl|bits|size)\s*=\s*(\S+)\s*", text or "")
    if not m:
        raise QuantkitError(f"--budget must be kl=NATS, bits=AVERAGE or size=BYTES (e.g. kl=0.05, bits=4.5, size=800MB), got {text!r}")
    kind, value = m.groups()
    try:
        number = parse_size(value) if kind == "size" else float(value)
    except (QuantkitError, ValueError):
        raise QuantkitError(f"--budget {kind}= needs a number{' with a unit (800MB)' if kind == 'size' else ''}, got {value!r}") from None
    if number <= 0:
        raise QuantkitError(f"--budget {kind}= must be positive, got {value!r}")
    return Budget(kind, float(number))


def parse_choice(label: str, symmetric: bool = True) -> Choice:
    """w4g128 / w4g64 / w4 (per channel) / w8 (per channel) / w8g128 / dense; also w5 and w6 with or without a group
    (smaller than w8 at a fraction of w4's error; vLLM runs them only through its Humming kernels, on CUDA)."""
    if label == "dense":
        return Choice(label, None)
    m = re.fullmatch(r"w([4-68])(?:g(\d+))?", label)
    if not m or (m.group(2) and (int(m.group(2)) <= 0 or int(m.group(2)) % 8)):
        raise QuantkitError(f"unknown choice {label!r}: use w4g<GROUP>, w4, w8, w8g<GROUP>, w6g<GROUP>, w5g<GROUP> or dense "
                            "(e.g. w4g128,w8,dense)")
    return Choice(label, Scheme(bits=int(m.group(1)), group_size=int(m.group(2)) if m.group(2) else None, symmetric=symmetric))


def parse_choices(text: str | None, units: list[Unit], symmetric: bool = True) -> list[Choice]:
    """The user's list, or the default for the model: 4-bit at the largest group (128, 64, 32) dividing every
    width and at half that, 8-bit per channel, dense."""
    if text is not None:
        choices = [parse_choice(c.strip(), symmetric) for c in text.split(",") if c.strip()]
        if not choices:
            raise QuantkitError("--choices is empty: give e.g. w4g128,w8,dense")
        return list({c.label: c for c in choices}.values())
    widths = {s[1] for u in units for s in u.shapes}
    group = next((g for g in (DEFAULT_GROUP_4BIT, *FALLBACK_GROUPS) if all(w % g == 0 for w in widths)), None)
    labels = ([f"w4g{group}"] + ([f"w4g{group // 2}"] if group and group >= 64 else [])) if group else ["w4"]
    return [parse_choice(x, symmetric) for x in [*labels, "w8", "dense"]]


def fits(choice: Choice, unit: Unit) -> bool:
    s = choice.scheme
    divides = s is None or s.group_size is None or all(w[1] % s.group_size == 0 for w in unit.shapes)
    if unit.table:  # (a table's rows are looked up one at a time: 8 bits, one scale per row or per group of a row)
        return divides and (s is None or s.bits == 8)
    return divides and not choice.tables_only


def with_table_choices(choices: list[Choice], symmetric: bool = True) -> list[Choice]:
    """The user's choices plus, where missing, what a vocabulary table may take: dense, int8 per row, and int8 with
    a scale per 32 values of a row. On SmolLM2 (its tied table is 42% of the weights) int8 rows alone cost 0.0014 nats,
    half of what every Linear at W8 costs, and groups of 32 0.0001 for 6% more bytes (bench/vocab_table_formats.py)."""
    have = {c.label for c in choices}
    extra = [Choice(c.label, c.scheme, tables_only=True) for c in (parse_choice(x, symmetric) for x in (*TABLE_SCHEMES, "dense"))
             if c.label not in have]
    return [*choices, *extra]


def table_units(model) -> list[Unit]:
    """The embedding (its tied head with it: one table) and an untied head, as budget units."""
    embed = model.get_input_embeddings()
    units = [Unit(EMBED, -1, [EMBED], [tuple(embed.weight.shape)], table=True)]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not embed.weight:
        units.append(Unit(HEAD, -1, [HEAD], [tuple(head.weight.shape)], table=True))
    return units


def unit_bytes(unit: Unit, choice: Choice, dtype_bytes: int = 2) -> int:
    """On-disk bytes of a unit's weights: packed values, scales in the checkpoint dtype, packed zero points."""
    total = 0
    for out, inp in unit.shapes:
        s = choice.scheme
        if s is None:
            total += out * inp * dtype_bytes
            continue
        groups = inp // (s.group_size or inp)
        total += (out * -(-inp * s.bits // 32) * 4 + out * groups * dtype_bytes  # values packed densely into int32 rows
                  + (0 if s.symmetric else -(-out * s.bits // 32) * 4 * groups))
    return total


def units_of(layers, prefix: str, arch: Arch) -> list[Unit]:
    """Each decoder layer's q/k/v, o, gate/up and down, as the checkpoint names them."""
    if arch.moe is not None:
        raise QuantkitError("--budget does not support mixture-of-experts models yet (experts would be units of their own)")
    groups = {"qkv": list(arch.qkv), "o": ["self_attn.o_proj"], "gate_up": list(arch.gate_up), "down": ["mlp.down_proj"]}
    units = []
    for i, layer in enumerate(layers):
        for tag, names in groups.items():
            mods = [layer.get_submodule(n) for n in names]
            units.append(Unit(f"{prefix}.{i}.{tag}", i, [f"{prefix}.{i}.{n}" for n in names],
                              [(m.out_features, m.in_features) for m in mods]))
    return units


@dataclass(slots=True)
class Plan:
    mix: dict[str, Choice]  # unit name -> choice
    predicted_kl: float
    bytes: int  # the units' weights

    def schemes(self, units: list[Unit]) -> dict[str, Scheme]:
        """module name -> scheme of every quantized Linear (dense units are left out)."""
        return {m: self.mix[u.name].scheme for u in units for m in u.modules if self.mix[u.name].scheme is not None}


def choose(units: list[Unit], options: dict[str, dict[str, tuple[int, float]]], choices: list[Choice],
           kl_limit: float | None = None, byte_limit: float | None = None) -> Plan:
    """options[unit][choice label] = (bytes, predicted KL). With `kl_limit`: the fewest bytes whose predicted KL is at
    most it; with `byte_limit`: the least predicted KL within it. Raises when no mix can meet the limit."""
    by_label = {c.label: c for c in choices}
    at: dict[str, int] = {}
    hulls: dict[str, list[tuple[int, float, str]]] = {}
    segments = []
    for u in units:
        hull = _lower_hull(sorted((b, kl, label) for label, (b, kl) in options[u.name].items()))
        hulls[u.name], at[u.name] = hull, 0
        segments += [((hull[j + 1][1] - hull[j][1]) / max(hull[j + 1][0] - hull[j][0], 1), u.name, j) for j in range(len(hull) - 1)]
    total_b = sum(h[0][0] for h in hulls.values())
    total_kl = sum(h[0][1] for h in hulls.values())
    if byte_limit is not None and total_b > byte_limit:
        raise QuantkitError(f"the budget cannot be met: the smallest mix ({'every unit at its smallest choice'}) is "
                            f"{total_b / 1e6:.1f} MB of Linear weights, over the {byte_limit / 1e6:.1f} MB the budget leaves them")
    blocked: set[str] = set()
    for slope, name, j in sorted(segments):  # steepest KL drop per byte first; within a unit the hull keeps the order
        if kl_limit is not None and total_kl <= kl_limit:
            break
        lo, hi = hulls[name][j], hulls[name][j + 1]
        if name in blocked or (byte_limit is not None and total_b + hi[0] - lo[0] > byte_limit):
            blocked.add(name)  # this upgrade does not fit: the unit stays, cheaper upgrades of others may still fit
            continue
        at[name], total_b, total_kl = j + 1, total_b + hi[0] - lo[0], total_kl + hi[1] - lo[1]
    if kl_limit is not None and total_kl > kl_limit * (1 + 1e-9):
        raise QuantkitError(f"the budget cannot be met: even the largest choices ({', '.join(c.label for c in choices)}) are "
                            f"predicted at mean KL {total_kl:.4f} > {kl_limit:g}; add 'dense' (or w8) to --choices")
    return Plan({n: by_label[hulls[n][at[n]][2]] for n in hulls}, total_kl, total_b)


def _lower_hull(points: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """(bytes, kl, label) sorted by bytes -> the points on the lower-left convex hull, KL falling as bytes grow."""
    hull: list[tuple[int, float, str]] = []
    for p in points:
        if hull and p[1] >= hull[-1][1]:
            continue  # more bytes, no less KL: dominated
        while len(hull) >= 2:
            (b1, k1, _), (b2, k2, _) = hull[-2], hull[-1]
            if (k2 - k1) * (p[0] - b1) >= (p[1] - k1) * (b2 - b1):  # the middle point is above the line: not on the hull
                hull.pop()
            else:
                break
        hull.append(p)
    return hull
