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

def parse_calls(text: str) -> list[dict] | None:
    """Calls as `[{name: {args}}]` from <tool_call> blocks (object or list), bare JSON, or python syntax.
    [] when the text holds no call; None when it tried to call and the call does not parse."""
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
    if blocks:
        calls = []
        for b in blocks:
            parsed = _json_calls(b)
            if parsed is None:
                return None
            calls += parsed
        return calls
    stripped = text.strip().strip("`").removeprefix("json").strip()
    python_like = re.match(r"^\[?\s*[A-Za-z_][\w.]*\(.*\)\s*\]?$", stripped, re.DOTALL)
    if stripped.startswith(("{", "[")) and not python_like:
        return _json_calls(stripped)
    if python_like:
        return _python_calls(stripped)
    return []


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
