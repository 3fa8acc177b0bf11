"""Integration on Qwen2.5-Coder-0.5B-Instruct, a model that calls tools: quantize it with the alias, serve it,
and evaluate it on real BFCL items with its own chat template's tools section."""

from __future__ import annotations

import json

import pytest

from tests.conftest import Server, run_cli

pytestmark = pytest.mark.integration

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Search flights between two cities",
                                      "parameters": {"type": "object", "properties": {"origin": {"type": "string"},
                                                                                      "destination": {"type": "string"}},
                                                     "required": ["origin", "destination"]}}},
]


@pytest.fixture(scope="module")
def qwen_server(qwen05_w4):
    server = Server(qwen05_w4, "--served-model-name", "qwen", "--kv-cache-memory", "0.5", timeout=300)
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("question, name, wanted", [
    ("What's the weather in Paris right now?", "get_weather", {"city": "Paris"}),
    ("Find me a flight from Boston to Denver.", "search_flights", {"origin": "Boston", "destination": "Denver"}),
])
def test_served_tool_calls(qwen_server, question, name, wanted):
    """The model answers in its own way (here often a ```json fence); the client gets `tool_calls` either way."""
    client = qwen_server.client()
    ask = dict(model="qwen", messages=[{"role": "user", "content": question}], tools=TOOLS, temperature=0, max_tokens=96)
    r = client.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    call = choice.message.tool_calls[0].function
    assert call.name == name and json.loads(call.arguments) == wanted
    streamed = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    deltas = [d for c in streamed for d in (c.delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == [name] and json.loads(deltas[0].function.arguments) == wanted
    assert streamed[-1].finish_reason == "tool_calls"


def test_eval_tool_use_with_native_tools(qwen05_w4, tmp_path, capsys):
    """Real BFCL items through the model's own tools template, both models on quantkit's engine."""
    code, out, err = run_cli(capsys, "eval", str(qwen05_w4), "--tasks", "tool-use", "--bfcl", "simple,irrelevance",
                             "--bfcl-limit", "8", "--out", str(tmp_path / "ev"), "--json", "--no-cache")
    assert code == 0, err
    tool = json.loads(out)["details"]["tool_use"]
    assert tool["native_tools"] is True
    assert set(tool["by_category"]) == {"simple", "irrelevance"} and tool["paired"]["n"] == 8
    assert tool["paired"]["baseline"] >= 0.5  # this model calls tools; SmolLM2 scored under the 20% floor
    items = [i for i in json.loads((tmp_path / "ev/results.json").read_text())["items"] if i["category"] == "simple"]
    assert all(i["baseline"]["parsed"] for i in items) and any(i["baseline"]["calls"] for i in items)
