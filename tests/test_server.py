"""`quantkit serve` through the official `openai` client: a real server process on a loopback port."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.conftest import SERVER_KEY, Server

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# one earlier call and its answer in the conversation: SmolLM2-135M then calls the tool again for Paris
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Berlin"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
    {"role": "assistant", "content": "It is 12 C and cloudy in Berlin."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_health_tokenize(smollm2_server):
    client = smollm2_server.client()
    assert [m.id for m in client.models.list().data] == ["smollm2-w4"]
    assert httpx.get(smollm2_server.base + "/health").status_code == 200  # no key needed
    h = smollm2_server.headers()
    ids = httpx.post(smollm2_server.base + "/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert ids["count"] == len(ids["tokens"]) == 2 and ids["max_model_len"] > 0
    back = httpx.post(smollm2_server.base + "/detokenize", json={"tokens": ids["tokens"]}, headers=h).json()
    assert back["prompt"] == "Hello world"


def test_chat_and_streamed_chat_agree(smollm2_server):
    client = smollm2_server.client()
    r = client.chat.completions.create(model="smollm2-w4", messages=QUESTION, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason in ("stop", "length")
    chat_ids = httpx.post(smollm2_server.base + "/tokenize", json={"messages": QUESTION}, headers=smollm2_server.headers()).json()
    assert r.usage.prompt_tokens == chat_ids["count"] and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="smollm2-w4", messages=QUESTION, temperature=0, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_chat_logprobs_and_n(smollm2_server):
    client = smollm2_server.client()
    r = client.chat.completions.create(model="smollm2-w4", messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the best of its top 3
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content.strip()[:5])
    sampled = client.chat.completions.create(model="smollm2-w4", messages=QUESTION, temperature=1.0, max_tokens=12, n=3, seed=5)
    again = client.chat.completions.create(model="smollm2-w4", messages=QUESTION, temperature=1.0, max_tokens=12, n=3, seed=5)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]  # a seed repeats


def test_completions_with_echo_and_logprobs_match_hf(smollm2_server, smollm2_w4):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = smollm2_server.client()
    prompt = "The capital of France is Paris. The capital of Italy is"
    r = client.completions.create(model="smollm2-w4", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt) and r.usage.completion_tokens <= 3
    tok = AutoTokenizer.from_pretrained(smollm2_w4)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 3
    assert lp.text_offset[: 3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_w4, dtype=torch.float32).eval()  # HF reading the same checkpoint
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [want[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    got = lp.token_logprobs[1 : len(ids)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.05, (got, want)

    zero = client.completions.create(model="smollm2-w4", prompt=[ids, ids[:5]], max_tokens=0, logprobs=0, echo=True)
    assert [c.finish_reason for c in zero.choices] == ["length", "length"] and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(got, abs=1e-4)  # scored once per prompt, same numbers
    assert zero.choices[1].text == tok.decode(ids[:5])


def test_tool_call_plain_and_streamed(smollm2_server):
    client = smollm2_server.client()
    r = client.chat.completions.create(model="smollm2-w4", messages=FEW_SHOT, tools=WEATHER, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"} and call.id

    chunks = list(client.chat.completions.create(model="smollm2-w4", messages=FEW_SHOT, tools=WEATHER, temperature=0,
                                                 max_tokens=40, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"] and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # the call never leaked as content

    plain = client.chat.completions.create(model="smollm2-w4", messages=QUESTION, tools=WEATHER, tool_choice="none",
                                           temperature=0, max_tokens=12)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_json_mode_returns_one_json_object(smollm2_server):
    client = smollm2_server.client()
    ask = [{"role": "user", "content": "Return a JSON object with keys city and country for Paris."}]
    r = client.chat.completions.create(model="smollm2-w4", messages=ask, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = client.chat.completions.create(model="smollm2-w4", messages=ask, temperature=0, max_tokens=60, stream=True,
                                            response_format={"type": "json_object"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    free = client.chat.completions.create(model="smollm2-w4", messages=ask, temperature=0, max_tokens=60)
    assert not free.choices[0].message.content.startswith("{")  # unconstrained, this model wraps it in prose or a fence
    sampled = client.chat.completions.create(model="smollm2-w4", messages=ask, temperature=0.7, seed=3, max_tokens=20, n=3,
                                             response_format={"type": "json_object"})
    for c in sampled.choices:  # complete or cut by max_tokens, the text is always the start of one JSON object
        assert c.message.content.lstrip().startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model="smollm2-w4", messages=ask, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    # completions take it too (vLLM's extension), the same way, rather than ignoring it
    prompt = "Paris as a JSON object with keys city and country:"
    text = client.completions.create(model="smollm2-w4", prompt=prompt, temperature=0, max_tokens=60,
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.completions.create(model="smollm2-w4", prompt=prompt, extra_body={"response_format": {"type": "json_schema"}})


def test_errors_are_openai_style_and_leave_the_server_up(smollm2_server):
    client = smollm2_server.client()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="smollm2-w4", prompt=[1] * 9000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smollm2-w4", prompt="hi", max_tokens="many")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="smollm2-w4", prompt="hi", presence_penalty=0.5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="unknown message role 'wizard': use one of system, developer, user"):
        client.chat.completions.create(model="smollm2-w4", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="a user message needs `content`"):
        client.chat.completions.create(model="smollm2-w4", messages=[{"role": "user"}])
    dev = client.chat.completions.create(model="smollm2-w4", max_tokens=2, temperature=0,
                                         messages=[{"role": "developer", "content": "Be brief."}, *QUESTION])
    assert dev.choices[0].message.content
    bad = httpx.post(smollm2_server.base + "/v1/chat/completions", content=b'{"messages": [',
                     headers={**smollm2_server.headers(), "Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("invalid JSON body")
    r = client.completions.create(model="smollm2-w4", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert r.choices[0].text


def test_api_key_required_except_health(smollm2_server):
    wrong = openai.OpenAI(base_url=smollm2_server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(smollm2_server.base + "/metrics").status_code == 401
    assert httpx.get(smollm2_server.base + "/health").status_code == 200
    assert smollm2_server.key == SERVER_KEY


def test_disconnect_aborts_and_frees_blocks(smollm2_server):
    base, h = smollm2_server.base, smollm2_server.headers()
    body = {"model": "smollm2-w4", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, headers=h, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # the client goes away mid-stream
    def impatient():  # a non-streaming client that gives up after 2 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, headers=h, timeout=2)

    t = threading.Thread(target=impatient)
    t.start()
    seen = time.monotonic() + 1.9  # it is running before the client gives up (polled: a busy machine starts it late)
    while smollm2_server.metrics()["quantkit:num_requests_running"] < 1:
        assert time.monotonic() < seen, "the impatient request never ran"
        time.sleep(0.1)
    t.join()
    deadline = time.monotonic() + 30
    while (m := smollm2_server.metrics())["quantkit:num_requests_running"] or m["quantkit:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["quantkit:num_requests_waiting"] == 0


def test_backpressure_and_graceful_shutdown(smollm2_w4):
    """One slot, one waiting place: the third concurrent request gets 429 with Retry-After; on SIGTERM the
    running request still completes and the server exits 0. The 429 is sent only once /metrics shows one request
    running and one waiting (polled, not slept: on a busy machine a thread's request can arrive late), and the
    real 135M model keeps the first one running for seconds, not the fraction of one a tiny model needs."""
    # a drain long enough for both requests on a busy machine (the default 30 s is not, with 2 x 300 tokens)
    server = Server(smollm2_w4, "--max-num-seqs", "1", "--max-waiting", "1", "--drain-seconds", "600")
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    results: dict[int, httpx.Response] = {}

    def post(i):
        results[i] = httpx.post(server.base + "/v1/completions", json=body, timeout=180)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while (m := server.metrics())["quantkit:num_requests_running"] < 1 or m["quantkit:num_requests_waiting"] < 1:
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        busy = httpx.post(server.base + "/v1/completions", json=body, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        code = server.stop(timeout=600)  # as long as the drain: both requests run to the end first
        for t in threads:
            t.join()
    assert code == 0
    assert len(results) == 2
    assert all(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length" for r in results.values())
    said = " ".join((server.proc.stdout.read() + server.proc.stderr.read()).split())
    split = re.search(r"ready in ([\d.]+) s \(import ([\d.]+), kernels ([\d.]+), load ([\d.]+), repack ([\d.]+), "
                      r"warm-up ([\d.]+), listen ([\d.]+)\)", said)
    assert split, said  # start-up as a user waits for it, split into its phases (which add up, to rounding)
    total, *parts = (float(x) for x in split.groups())
    assert abs(total - sum(parts)) <= 0.35



def test_shutdown_after_the_drain_runs_out_aborts_and_exits_0(smollm2_w4):
    """SIGTERM with a request that cannot finish within --drain-seconds: the server answers it with an error
    (uvicorn cancels it), closes its event loop, and the engine thread, which may still be stepping that
    request, goes on to its own shutdown: exit 0, not a crash on the closed loop."""
    server = Server(smollm2_w4, "--drain-seconds", "1")
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    results: dict[int, httpx.Response] = {}
    thread = threading.Thread(target=lambda: results.update({0: httpx.post(server.base + "/v1/completions", json=body, timeout=180)}))
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while server.metrics()["quantkit:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        code = server.stop()
        thread.join()
    assert code == 0, server.proc.stderr.read()[-2000:]
    assert results[0].status_code >= 500  # cut off, and said so: not a truncated 200

def test_bench_url_sweep_against_the_server(smollm2_server, smollm2_w4, tmp_path, capsys):
    from tests.conftest import run_cli

    plot = tmp_path / "sweep.png"
    code, out, err = run_cli(capsys, "bench", smollm2_server.base, "--sweep", "1,2", "-n", "4", "--input-len", "16",
                             "--output-len", "8", "--plot", str(plot), "--api-key", SERVER_KEY, "--tokenizer", str(smollm2_w4), "--json")
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    for r in runs:
        assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] == 32 and r["input_tokens"] == 64  # ignore_eos held
        assert 0 < r["ttft_ms"]["p50"] <= r["e2el_ms"]["p50"] and r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["mean"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli(capsys, "bench", smollm2_server.base, "-n", "1", "--tokenizer", str(smollm2_w4), "-q")  # no key
    assert code == 2 and "401" in err and err.count("error:") == 1


def test_forced_tool_calls(smollm2_server):
    client = smollm2_server.client()
    clock = {"type": "function", "function": {"name": "get_time", "description": "Current local time in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    tools, ask = [*WEATHER, clock], [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="smollm2-w4", messages=ask, tools=tools, tool_choice=named, temperature=0, max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments), dict)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None

    chunks = list(client.chat.completions.create(model="smollm2-w4", messages=ask, tools=tools, tool_choice=named, temperature=0,
                                                 max_tokens=40, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_time", call.function.arguments)]

    required = client.chat.completions.create(model="smollm2-w4", messages=ask, tools=tools, tool_choice="required",
                                              temperature=0, max_tokens=40)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)  # the likelier name
    with pytest.raises(openai.BadRequestError, match="not among the offered tools"):
        client.chat.completions.create(model="smollm2-w4", messages=ask, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "launch"}})
