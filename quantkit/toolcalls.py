"""Tool calls in free text: the system prompt that asks a model without a tools-aware chat template to call
functions, and the parser that reads calls back out of what it wrote. Shared by `quantkit eval` (tool use)
and `quantkit serve` (`tools` in chat completions)."""

from __future__ import annotations

import ast
import json
import re

SYSTEM_PROMPT = (
    "You can call functions. The available functions, as JSON schemas:\n{tools}\n\n"
    "If the request needs one or more of them, answer only with the calls, one per line, each as\n"
    '<tool_call>{{"name": "function_name", "arguments": {{"argument": value}}}}</tool_call>\n'
    "If none of the functions applies, answer the request in plain text without any call."
)

FENCE = re.compile(r"```[ \t]*([A-Za-z_]*)[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
PYTHON_CALLS = re.compile(r"^\[?\s*[A-Za-z_][\w.]*\(.*\)\s*\]?$", re.DOTALL)


def parse_calls(text: str) -> list[dict] | None:
    """Calls as `[{name: {args}}]` from <tool_call> blocks (object or list), fenced ```json blocks (anywhere in
    the text: models often wrap a call in a fence with prose around it), bare JSON, or python call syntax.
    [] when the text holds no call; None when it tried to call and the call does not parse."""
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
    if blocks:
        return _all_or_none([_json_calls(b) for b in blocks])
    fenced = FENCE.findall(text)
    if fenced:
        return _all_or_none([_fenced_calls(lang.lower(), body.strip()) for lang, body in fenced])
    stripped = text.strip()
    python_like = PYTHON_CALLS.match(stripped)
    if stripped.startswith(("{", "[")) and not python_like:
        return _json_calls(stripped)
    if python_like:
        return _python_calls(stripped)
    return []


def only_calls(text: str) -> bool:
    """Whether the text is nothing but calls: no prose around its <tool_call> blocks or fences."""
    rest = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.DOTALL)
    rest = FENCE.sub("", rest) if FENCE.search(rest) else rest
    return not rest.strip() or rest.strip() == text.strip() and text.strip().startswith(("{", "["))


def _fenced_calls(lang: str, body: str) -> list[dict] | None:
    """A fence tagged json (or untagged and holding JSON) is a call attempt; code in another fence is a call
    only when it is python call syntax, and otherwise no call at all."""
    if lang in ("json", "tool_call"):
        return _json_calls(body)
    if PYTHON_CALLS.match(body):
        return _python_calls(body) or []
    return _json_calls(body) if not lang and body.startswith(("{", "[")) else []


def _all_or_none(parts: list[list[dict] | None]) -> list[dict] | None:
    if any(p is None for p in parts):
        return None
    return [c for p in parts for c in p]


def _json_calls(text: str) -> list[dict] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    objs = data if isinstance(data, list) else [data]
    calls = []
    for o in objs:
        if not isinstance(o, dict):
            return None
        if "name" in o:
            args = o.get("arguments", o.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            calls.append({o["name"]: args})
        elif len(o) == 1 and isinstance(next(iter(o.values())), dict):
            calls.append(o)
        else:
            return None
    return calls


def _python_calls(text: str) -> list[dict] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        try:
            calls.append({ast.unparse(node.func): {k.arg: ast.literal_eval(k.value) for k in node.keywords}})
        except ValueError:
            return None
    return calls
