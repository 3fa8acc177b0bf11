"""Our AST checker agrees with the bfcl-eval package's own checker, item by item, on BFCL's real data.

Both checkers see the same model outputs: the correct calls built from the ground truth and a set of
mutations of them (wrong name, missing or extra argument, wrong value or type, int for float, changed
string spelling, reordered or dropped parallel calls). bfcl-eval is installed with --no-deps; its checker
imports a model-config table only for a name mapping, so a stub stands in for that module.
"""

import copy
import importlib.util
import json
import random
import sys
import types
from pathlib import Path

import pytest

from quantkit.eval.checker import check

CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel", "irrelevance": "irrelevance"}
PER_CATEGORY = 40


@pytest.fixture(scope="module")
def bfcl():
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None:
        pytest.skip("bfcl-eval is not installed (pip install --no-deps bfcl-eval)")
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = type("AnyModel", (dict,), {"__missing__": lambda self, k: types.SimpleNamespace(underscore_to_dot=False)})()
    sys.modules["bfcl_eval.constants.model_config"] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    root = Path(spec.origin).parent / "data"
    return types.SimpleNamespace(ast_checker=ast_checker, python=Language.PYTHON, root=root)


def load(root: Path, name: str, n: int):
    items = [json.loads(x) for x in (root / f"BFCL_v4_{name}.json").read_text().splitlines() if x.strip()]
    answers = {}
    answer_file = root / "possible_answer" / f"BFCL_v4_{name}.json"
    if answer_file.exists():
        answers = {a["id"]: a["ground_truth"] for a in map(json.loads, answer_file.read_text().splitlines()) if a}
    rng = random.Random(0)
    return [(item, answers.get(item["id"])) for item in rng.sample(items, min(n, len(items)))]


def correct_calls(truth):
    return [{name: {p: opts[0] for p, opts in args.items() if opts and opts[0] != ""}} for call in truth for name, args in call.items()]


def mutations(item, truth, rng):
    """Outputs to judge: right ones and many kinds of wrong ones."""
    if truth is None:  # irrelevance: any call is wrong, no call (or a non-call) is right
        f = item["function"][0]
        args = {p: 1 for p in f["parameters"].get("required", [])}
        return [[], [{}], [{f["name"]: args}], [{f["name"]: {}}], "plain text answer"]
    good = correct_calls(truth)
    outs = [good]
    for transform in (_rename, _drop_arg, _extra_arg, _bump_value, _stringify, _respell, _int_for_float, _reorder, _drop_call):
        out = transform(copy.deepcopy(good), item, rng)
        if out is not None:
            outs.append(out)
    return outs


def _first_args(calls):
    name = next(iter(calls[0]))
    return name, calls[0][name]


def _rename(calls, item, rng):
    name, args = _first_args(calls)
    calls[0] = {name + "_v2": args}
    return calls


def _drop_arg(calls, item, rng):
    name, args = _first_args(calls)
    if not args:
        return None
    args.pop(rng.choice(sorted(args)))
    return calls


def _extra_arg(calls, item, rng):
    _first_args(calls)[1]["unexpected_flag"] = True
    return calls


def _bump_value(calls, item, rng):
    name, args = _first_args(calls)
    for p, v in args.items():
        if isinstance(v, bool):
            args[p] = not v
        elif isinstance(v, (int, float)):
            args[p] = v + 1
        elif isinstance(v, str):
            args[p] = v + " extra"
        else:
            continue
        return calls
    return None


def _stringify(calls, item, rng):
    name, args = _first_args(calls)
    for p, v in args.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            args[p] = str(v)
            return calls
    return None


def _respell(calls, item, rng):
    name, args = _first_args(calls)
    for p, v in args.items():
        if isinstance(v, str) and v:
            args[p] = v.upper().replace(" ", "  ") + "."  # normalisation should forgive this
            return calls
    return None


def _int_for_float(calls, item, rng):
    name, args = _first_args(calls)
    for p, v in args.items():
        if isinstance(v, float) and v.is_integer():
            args[p] = int(v)
            return calls
    return None


def _reorder(calls, item, rng):
    return calls[::-1] if len(calls) > 1 else None


def _drop_call(calls, item, rng):
    return calls[:-1] if len(calls) > 1 else None


def bfcl_verdict(bfcl, item, output, truth, category):
    if category == "irrelevance":  # BFCL's runner: correct when the decoded output holds no call
        from bfcl_eval.utils import is_empty_output

        return is_empty_output(output)
    if not isinstance(output, list):
        return False
    return bfcl.ast_checker(item["function"], output, truth, bfcl.python, CATEGORIES[category], "quantkit")["valid"]


def test_checker_agrees_with_bfcl_eval(bfcl):
    rng = random.Random(1)
    compared = {c: 0 for c in CATEGORIES}
    verdicts = {True: 0, False: 0}
    disagreements = []
    for category, name in CATEGORIES.items():
        for item, truth in load(bfcl.root, name, PER_CATEGORY):
            for output in mutations(item, truth, rng):
                theirs = bfcl_verdict(bfcl, item, output, truth, category)
                ours = check(item["function"], output if isinstance(output, list) else [], truth or [], category).valid
                compared[category] += 1
                verdicts[theirs] += 1
                if ours != theirs:
                    disagreements.append((item["id"], output, theirs, ours))
    print(f"\ncompared {sum(compared.values())} outputs {compared}; bfcl-eval judged {verdicts[True]} right, {verdicts[False]} wrong")
    assert not disagreements, disagreements[:5]
    assert verdicts[True] > 100 and verdicts[False] > 300
