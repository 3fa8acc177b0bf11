"""Tool-call correctness by the Berkeley Function Calling Leaderboard's AST rules.

A model's calls are a list of `{function_name: {argument: value}}`. Against a ground truth of the same
shape, where every argument lists its acceptable values ("" in the list = may be omitted):
- the function name must match; every required parameter must be present; no parameter may be outside
  the function's schema or the ground truth;
- each value must have the schema's type (an int is accepted where a float is expected; arrays check
  their items one level deep); a value of another type than the schema's, but of the type the ground
  truth uses, counts as a variable reference and is accepted as BFCL does;
- strings compare after normalisation (lower case; spaces and `,./-_*^` removed; ' -> "), also inside
  lists and dicts; other values compare exactly;
- parallel calls match the ground truth in any order, one to one; "multiple" expects exactly one call;
  irrelevance is correct when the model makes no call at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list, "dict": dict, "any": str}
NESTED = ("array", "tuple")
OPTIONAL = ""


@dataclass(slots=True)
class Check:
    valid: bool
    error: str = ""


def normalize(s: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _norm(v):
    return normalize(v) if isinstance(v, str) else v


def _answer_type(options: list):
    return next((type(o) for o in options if o != OPTIONAL), None)


def _type_ok(value, options: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(valid, is_variable) for one argument value."""
    answer_type = _answer_type(options)
    is_variable = answer_type is not None and answer_type != expected
    if type(value) is expected:
        if nested is None:
            return True, is_variable
        for option in options:
            if type(option) is list and all(_type_ok(v, option, nested, None)[0] for v in value):
                return True, is_variable
            if type(option) is not list:
                return True, is_variable
        return False, is_variable
    if answer_type is not None and type(value) is answer_type:
        return True, True
    return False, False


def _dict_ok(value: dict, options: list) -> bool:
    for option in options:
        if option == OPTIONAL:
            continue
        if all(k in option and _norm(v) in [_norm(o) for o in option[k]] for k, v in value.items()) and all(
            k in value or OPTIONAL in opts for k, opts in option.items()
        ):
            return True
    return False


def _list_of_dicts_ok(value: list, options: list) -> bool:
    return any(len(option) == len(value) and all(_dict_ok(v, [o]) for v, o in zip(value, option)) for option in options)


def check_call(schema: dict, call: dict, truth: dict) -> Check:
    """One call `{name: {arg: value}}` against one ground-truth call `{name: {arg: [options]}}`."""
    name = schema["name"]
    if name not in call:
        return Check(False, f"wrong function: expected {name}")
    args, answers = call[name], next(iter(truth.values()))
    props, required = schema["parameters"].get("properties", {}), schema["parameters"].get("required", [])
    if not isinstance(args, dict):
        return Check(False, "arguments are not an object")
    for p in required:
        if p not in args:
            return Check(False, f"missing required parameter {p}")
    for p, value in args.items():
        if p not in props or p not in answers:
            return Check(False, f"unexpected parameter {p}")
        kind = props[p].get("type", "any")
        expected = TYPES.get(kind, str)
        nested = TYPES.get(props[p].get("items", {}).get("type", "any")) if kind in NESTED else None
        if kind == "tuple" and isinstance(value, tuple):
            value = list(value)
        if kind == "float" and type(value) is int:
            value = float(value)
        ok, is_variable = _type_ok(value, answers[p], expected, nested)
        if not ok:
            return Check(False, f"wrong type for {p}: expected {kind}, got {type(value).__name__}")
        if is_variable:
            if value not in answers[p]:
                return Check(False, f"wrong value for {p}: {value!r}")
            continue
        if expected is dict:
            good = _dict_ok(value, answers[p])
        elif expected is list and nested is dict:
            good = _list_of_dicts_ok(value, answers[p])
        elif expected is str:
            good = normalize(value) in [normalize(o) for o in answers[p] if isinstance(o, str)]
        elif expected is list:
            # "" (optional) reads as an empty list here, as in BFCL: an empty list then matches it
            good = [_norm(v) for v in value] in [[_norm(o) for o in opt] for opt in answers[p]]
        else:
            good = value in answers[p]
        if not good:
            return Check(False, f"wrong value for {p}: {value!r}")
    for p, options in answers.items():
        if p not in args and OPTIONAL not in options:
            return Check(False, f"missing parameter {p}")
    return Check(True)


def made_call(calls) -> bool:
    """Whether the output holds a real call: a non-empty list of `{name: {args}}`, and not just `[{}]`."""
    if not isinstance(calls, list) or not calls:
        return False
    return all(isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict) for c in calls)


def _schema(functions: list[dict], name: str) -> dict | None:
    return next((f for f in functions if f["name"] == name), None)


def check(functions: list[dict], calls: list[dict], truth: list[dict], category: str) -> Check:
    """A model's calls for one item of a BFCL category (simple, multiple, parallel, parallel_multiple,
    irrelevance) against its ground truth (unused for irrelevance)."""
    if "irrelevance" in category:
        called = made_call(calls)
        return Check(not called, "called a function where none applies" if called else "")
    if len(calls) != len(truth):
        return Check(False, f"expected {len(truth)} call(s), got {len(calls)}")
    if "parallel" not in category:
        return check_call(_schema(functions, next(iter(truth[0]))) or functions[0], calls[0], truth[0])
    used: set[int] = set()
    for t in truth:
        schema = _schema(functions, next(iter(t)))
        match = next((i for i, c in enumerate(calls) if i not in used and schema and check_call(schema, c, t).valid), None)
        if match is None:
            return Check(False, f"no call matches {next(iter(t))}")
        used.add(match)
    return Check(True)
