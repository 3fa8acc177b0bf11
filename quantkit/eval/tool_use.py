"""Tool use in the BFCL schema: prompts, parsing the calls out of free text, and sub-scores.

Prompts use the model's chat template with `tools=` when the template has a tools section, and otherwise
this system prompt (so any model can be asked the same way):
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantkit import QuantkitError
from quantkit.eval.checker import check, made_call
from quantkit.toolcalls import SYSTEM_PROMPT, parse_calls

__doc__ += "\n    " + SYSTEM_PROMPT.replace("\n", "\n    ") + "\n"


@dataclass(slots=True)
class ToolItem:
    id: str
    category: str
    messages: list[dict]
    functions: list[dict]
    ground_truth: list[dict]


def bundled_path() -> Path:
    here = Path(__file__).resolve().parent.parent
    installed = here / "_bundled" / "evals" / "tool_use.jsonl"
    return installed if installed.exists() else here.parent / "evals" / "tool_use.jsonl"


def load_items(path: Path, category: str | None = None, answers: Path | None = None) -> list[ToolItem]:
    """A BFCL-format JSON-lines file; ground truth inline or in a separate `possible_answer` file."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        truth = {}
        if answers and answers.exists():
            truth = {a["id"]: a["ground_truth"] for a in map(json.loads, answers.read_text().splitlines()) if a}
        items = []
        for r in rows:
            cat = r.get("category") or category or _category_of(r["id"])
            items.append(ToolItem(r["id"], cat, r["question"][0], r["function"], r.get("ground_truth") or truth.get(r["id"], [])))
    except FileNotFoundError:
        raise QuantkitError(f"no tool-use file at {path}") from None
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise QuantkitError(f"{path} is not BFCL-format JSON lines ({type(e).__name__}: {e})") from None
    return items


def _category_of(item_id: str) -> str:
    for cat in ("parallel_multiple", "irrelevance", "parallel", "multiple", "simple"):
        if cat in item_id:
            return cat
    return "simple"


def openai_tools(functions: list[dict]) -> list[dict]:
    """BFCL's schema ("dict" types) as OpenAI-style tools for chat templates."""
    def fix(schema):
        if isinstance(schema, dict):
            return {k: ("object" if k == "type" and v == "dict" else fix(v)) for k, v in schema.items()}
        if isinstance(schema, list):
            return [fix(s) for s in schema]
        return schema

    return [{"type": "function", "function": fix(f)} for f in functions]


def messages_for(item: ToolItem, native_tools: bool) -> tuple[list[dict], list[dict] | None]:
    if native_tools:
        return item.messages, openai_tools(item.functions)
    system = SYSTEM_PROMPT.format(tools=json.dumps(item.functions, indent=1))
    return [{"role": "system", "content": system}, *item.messages], None


@dataclass(slots=True)
class ToolScore:
    correct: bool
    parsed: bool
    called: bool
    right_functions: bool
    error: str


def score_item(item: ToolItem, output: str) -> tuple[ToolScore, list[dict] | None]:
    calls = parse_calls(output)
    judged = check(item.functions, calls or [], item.ground_truth, item.category)
    called = made_call(calls or [])
    wanted = sorted(next(iter(t)) for t in item.ground_truth)
    got = sorted(next(iter(c)) for c in (calls or []) if isinstance(c, dict) and c)
    return ToolScore(judged.valid, calls is not None, called, wanted == got, judged.error), calls
