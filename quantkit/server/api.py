"""The OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics,
/tokenize, /detokenize, on FastAPI over the background-stepping engine.

Every request is validated before it reaches the engine (a 400 with an OpenAI-style body otherwise), so
a bad request never disturbs the others; a client that goes away has its request aborted.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException

from quantkit import QuantkitError
from quantkit.runtime.engine import RequestOutput
from quantkit.runtime.sampler import Sample, SamplingParams
from quantkit.server.async_engine import AsyncEngine, EngineError
from quantkit.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    unsupported,
)
from quantkit.server.protocol import Request as ApiRequest
from quantkit.toolcalls import SYSTEM_PROMPT, only_calls, parse_calls


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass(slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests waiting for a slot before new ones get 429


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


class Api:
    """What the handlers share: the engine, its tokenizer, the limits and the sampling defaults."""

    def __init__(self, engine: AsyncEngine, cfg: ServerConfig):
        self.engine, self.cfg = engine, cfg
        core = engine.engine
        self.tokenizer = core.tokenizer
        self.limit = core.max_len  # tokens a sequence may reach
        self.defaults = _generation_defaults(core.path)
        self.created = int(time.time())
        self.rejected = 0

    # --- shared pieces --------------------------------------------------------------------------
    def piece(self, token: int) -> str:
        """A token's text as the API reports it in logprobs (decoded alone)."""
        return self.engine.engine.piece(token)

    def check(self, req: ApiRequest) -> None:
        if req.model is not None and req.model != self.cfg.served_model_name:
            raise ApiError(404, f"the model `{req.model}` does not exist: this server serves `{self.cfg.served_model_name}`",
                           "not_found_error", "model")
        if (name := unsupported(req)) is not None:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
        if not self.engine.alive:
            raise ApiError(503, "the engine is not running", "server_error")
        if self.engine.overloaded():
            self.rejected += 1
            raise ApiError(429, f"server busy: {self.engine.max_waiting} requests already wait for a slot; retry later",
                           "rate_limit_error")

    def budget(self, prompt: list[int], max_tokens: int | None) -> int:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(prompt) >= self.limit:
            raise ApiError(400, f"this model's maximum context length is {self.limit} tokens, but the prompt has "
                                f"{len(prompt)} tokens", param="prompt")
        if max_tokens is None:
            return self.limit - len(prompt)
        if len(prompt) + max_tokens > self.limit:
            raise ApiError(400, f"this model's maximum context length is {self.limit} tokens: the prompt ({len(prompt)}) "
                                f"plus max_tokens ({max_tokens}) exceed it", param="max_tokens")
        return max_tokens

    def params(self, req: ApiRequest, max_tokens: int, seed_offset: int, logprobs: int | None = None,
               prompt_logprobs: int | None = None, json_object: bool = False) -> SamplingParams:
        d = self.defaults
        pick = lambda v, name, default: v if v is not None else d.get(name, default)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
                top_k=max(pick(req.top_k, "top_k", 0), 0), min_p=pick(req.min_p, "min_p", 0.0),
                repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
                seed=None if req.seed is None else req.seed + seed_offset, stop=req.stops(),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, json_object=json_object)
        except QuantkitError as e:
            raise ApiError(400, str(e)) from None

    def choices(self, prompts: list[list[int]], req: ApiRequest, prefix: str, make) -> list[Choice]:
        """`n` choices per prompt, indexed as OpenAI does (prompt-major); `make(prompt index, choice j)` -> params."""
        return [Choice(i * req.n + j, f"{prefix}-{i * req.n + j}", p, make(i, j)) for i, p in enumerate(prompts) for j in range(req.n)]

    async def run(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's outputs as they come, interleaved; leaving early aborts the unfinished ones."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for out in self.engine.generate(c.request_id, c.prompt, c.params):
                    await merged.put((c, out))
            except Exception as e:  # noqa: BLE001  (delivered to the waiting handler)
                await merged.put((c, e))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            left = len(choices)
            while left:
                c, out = await merged.get()
                if isinstance(out, QuantkitError):
                    raise ApiError(400, str(out))
                if isinstance(out, Exception):
                    raise out
                left -= out.finished
                yield c, out
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, choices: list[Choice], raw: Request) -> dict[int, RequestOutput]:
        """Run to completion, unless the client disconnects first (then everything is aborted)."""
        final: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for c, out in self.run(choices):
                if out.finished:
                    final[c.index] = out

        work, gone = asyncio.create_task(consume()), asyncio.create_task(_disconnected(raw))
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            raise asyncio.CancelledError  # nobody to answer
        gone.cancel()
        work.result()
        return final

    # --- logprobs -------------------------------------------------------------------------------
    def completion_logprobs(self, tokens: list[int], samples: list[Sample | None], offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, s in zip(tokens, samples):
            piece = self.piece(token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(None if s is None else s.logprob)
            out["top_logprobs"].append(None if s is None else {**{self.piece(t): lp for t, lp in s.top}, piece: s.logprob})
            out["text_offset"].append(offset)
            offset += len(piece)
        return out

    def chat_logprobs(self, samples: list[Sample]) -> dict:
        entry = lambda token, lp: {"token": (p := self.piece(token)), "logprob": lp, "bytes": list(p.encode())}
        return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in samples]}


# --- the app ----------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    api = Api(engine, cfg)

    app = FastAPI(title="quantkit", docs_url=None, redoc_url=None)
    if cfg.api_key:
        app.add_middleware(ApiKey, key=cfg.api_key)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(error_body(e.message, e.kind, e.status, e.param), e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"invalid JSON body: {first.get('msg')}", code=400), 400)
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        msg = f"{where or 'body'}: {first.get('msg')}"
        return JSONResponse(error_body(msg, param=where or None, code=400), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", e.status_code), e.status_code)

    @app.exception_handler(EngineError)
    async def engine_error(_, e: EngineError):
        return JSONResponse(error_body(str(e), "server_error", 500), 500)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def models():
        card = {"id": cfg.served_model_name, "object": "model", "created": api.created, "owned_by": "quantkit",
                "max_model_len": api.limit}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics.render(cfg.served_model_name, engine.snapshot, api.rejected)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]):
        if "messages" in body:
            ids = _render_chat(api, body["messages"], None, body.get("add_generation_prompt", True))
        elif isinstance(body.get("prompt"), str):
            ids = api.tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        else:
            raise ApiError(400, "give `prompt` (a string) or `messages`", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": api.limit}

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any]):
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < len(api.tokenizer) for t in ids):
            raise ApiError(400, "`tokens` must be a list of token ids", param="tokens")
        return {"prompt": api.tokenizer.decode(ids)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await _completions(api, req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await _chat(api, req, raw)

    return app


class ApiKey:
    """Every path but /health needs `Authorization: Bearer KEY` (a plain ASGI layer, so streaming and
    disconnect detection pass through untouched)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key (send Authorization: Bearer KEY)", "invalid_request_error",
                                  "invalid_api_key")
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- /v1/completions ----------------------------------------------------------------------------
async def _completions(api: Api, req: CompletionRequest, raw: Request):
    api.check(req)
    prompts = _prompt_ids(api, req.prompt, req.add_special_tokens)
    top = req.logprobs
    budgets = [api.budget(p, req.max_tokens) for p in prompts]
    score = top if req.echo and top is not None else None
    rid = f"cmpl-{uuid.uuid4().hex}"
    json_mode = _json_mode(req)
    choices = api.choices(prompts, req, rid, lambda i, j: api.params(req, budgets[i], j, top, score, json_mode))
    usage_prompt = sum(map(len, prompts))
    if req.stream:
        return _sse(_completion_chunks(api, req, rid, choices, usage_prompt))
    final = await api.collect(choices, raw)
    out = []
    for c in choices:
        r = final[c.index]
        text, logprobs = r.text, None
        if top is not None:
            tokens, samples, offset = r.token_ids, list(r.samples), 0
            if req.echo:
                tokens, samples = c.prompt + tokens, [None, *r.prompt_samples] + samples
            logprobs = api.completion_logprobs(tokens, samples, offset)
        if req.echo:
            text = api.tokenizer.decode(c.prompt) + text
        out.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason})
    completion = sum(len(final[c.index].token_ids) for c in choices)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": api.cfg.served_model_name,
            "choices": out, "usage": _usage(usage_prompt, completion)}


async def _completion_chunks(api: Api, req: CompletionRequest, rid: str, choices: list[Choice], usage_prompt: int):
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": api.cfg.served_model_name}
    completion = 0
    if req.echo:
        for c in choices:
            yield {**head, "choices": [{"index": c.index, "text": api.tokenizer.decode(c.prompt), "logprobs": None, "finish_reason": None}]}
    async for c, out in api.run(choices):
        completion += len(out.new_token_ids)
        logprobs = None
        if req.logprobs is not None and out.new_token_ids:
            logprobs = api.completion_logprobs(out.new_token_ids, out.samples[-len(out.new_token_ids):], 0)
        if out.delta or out.finished or logprobs:
            yield {**head, "choices": [{"index": c.index, "text": out.delta, "logprobs": logprobs, "finish_reason": out.finish_reason}]}
    if req.stream_options and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage(usage_prompt, completion)}


def _prompt_ids(api: Api, prompt, special: bool = True) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    out = []
    vocab = len(api.tokenizer)
    for p in prompt:
        if isinstance(p, str):
            out.append(api.tokenizer(p, add_special_tokens=special)["input_ids"])
        else:
            if any(t < 0 or t >= vocab for t in p):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append(list(p))
    return out


def _json_mode(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether `response_format` asks for a JSON object; a schema is refused rather than ignored."""
    if req.response_format is None or req.response_format.type == "text":
        return False
    if req.response_format.type != "json_object":
        raise ApiError(400, "response_format json_schema is not supported: use {\"type\": \"json_object\"} (any JSON "
                            "object) and describe the fields in the prompt", param="response_format")
    return True


# --- /v1/chat/completions -----------------------------------------------------------------------
async def _chat(api: Api, req: ChatCompletionRequest, raw: Request):
    api.check(req)
    json_mode = _json_mode(req)
    tool_choice = req.tool_choice if req.tools else "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if tool_choice != "none" else []
    names = [t["function"]["name"] for t in tools]
    forced = _forced_name(tool_choice, names)
    if forced and json_mode:
        raise ApiError(400, "response_format json_object and a forced tool call cannot be combined", param="tool_choice")
    prompt = _render_chat(api, req.messages, tools, True)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if forced == "required":
        forced = names[0] if len(names) == 1 else await _pick_function(api, prompt, names, rid)
    if forced:  # the call is begun for the model; JSON mode writes its arguments
        prompt = prompt + api.tokenizer(_call_prefix(forced), add_special_tokens=False)["input_ids"]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    budget = api.budget(prompt, max_tokens)
    top = (req.top_logprobs or 0) if req.logprobs else None
    choices = api.choices([prompt], req, rid, lambda i, j: api.params(req, budget, j, top, json_object=json_mode or bool(forced)))
    offered = set() if json_mode or forced else set(names)
    if req.stream:
        return _sse(_chat_chunks(api, req, rid, choices, offered, forced))
    final = await api.collect(choices, raw)
    out = []
    for c in choices:
        r = final[c.index]
        message: dict[str, Any] = {"role": "assistant", "content": r.text}
        reason = r.finish_reason
        if forced:
            message, reason = {"role": "assistant", "content": None, "tool_calls": _forced_call(forced, r.text)}, _forced_reason(r)
        elif offered and (calls := _tool_calls(r.text, offered)):
            message, reason = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        logprobs = api.chat_logprobs(r.samples) if top is not None else None
        out.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
    completion = sum(len(final[c.index].token_ids) for c in choices)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": api.cfg.served_model_name,
            "choices": out, "usage": _usage(len(prompt), completion)}


async def _chat_chunks(api: Api, req: ChatCompletionRequest, rid: str, choices: list[Choice], names: set[str],
                       forced: str | None = None):
    """Content streams as it is made; with tools, output that may be a tool call is held until it is
    known, then sent as `tool_calls` (or as content after all); a forced call is sent whole at its end."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": api.cfg.served_model_name}
    chunk = lambda i, delta, reason=None, logprobs=None: {
        **head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
    held = {c.index: bool(names) for c in choices}  # still holding back text that may be a call
    shown = {c.index: "" for c in choices}  # settled text so far (the engine's deltas)
    sent = {c.index: 0 for c in choices}  # characters of it sent
    pending: dict[int, list[Sample]] = {c.index: [] for c in choices}  # samples not yet sent with logprobs
    completion = 0
    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    async for c, out in api.run(choices):
        i = c.index
        completion += len(out.new_token_ids)
        shown[i] += out.delta
        if req.logprobs and out.new_token_ids:
            pending[i] += out.samples[-len(out.new_token_ids):]
        if forced:
            if out.finished:
                yield chunk(i, {"tool_calls": [{"index": 0, **_forced_call(forced, out.text)[0]}]}, _forced_reason(out))
            continue
        if held[i] and not _may_be_call(out.text):
            held[i] = False
        if held[i] and not out.finished:
            continue
        if held[i] and (calls := _tool_calls(out.text, names)):
            yield chunk(i, {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}, "tool_calls")
            continue
        held[i] = False
        new = shown[i][sent[i]:]
        sent[i] += len(new)
        logprobs = api.chat_logprobs(pending[i]) if pending[i] else None
        pending[i] = []
        if new or out.finished or logprobs:
            yield chunk(i, {"content": new} if new else {}, out.finish_reason, logprobs)
    if req.stream_options and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage(len(choices[0].prompt), completion)}


CALL_STARTS = ("<tool_call>", "{", "[", "```")
NAME_START = '<tool_call>{"name": "'


def _call_prefix(name: str) -> str:
    """A forced call, begun in the prompt: the model writes only its arguments."""
    return f'{NAME_START}{name}", "arguments": '


def _forced_name(tool_choice, names: list[str]) -> str | None:
    """None (the model decides), "required" (some offered function), or the named function."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return "required"
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function":
        raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    name = (tool_choice.get("function") or {}).get("name")
    if name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the offered tools", param="tool_choice")
    return name


async def _pick_function(api: Api, prompt: list[int], names: list[str], rid: str) -> str:
    """`tool_choice: "required"` among several functions: the name the model itself finds most likely after
    `<tool_call>{"name": "`, by the summed log-probabilities of its tokens."""
    tok = api.tokenizer
    suffixes = [tok(f'{NAME_START}{n}"', add_special_tokens=False)["input_ids"] for n in names]
    shared = 0
    while all(len(x) > shared and x[shared] == suffixes[0][shared] for x in suffixes):
        shared += 1
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)

    async def total(k: int, suffix: list[int]) -> float:
        ids = prompt + suffix
        api.budget(ids, 0)
        async for out in api.engine.generate(f"{rid}-pick-{k}", ids, score):
            if out.finished:
                return sum(s.logprob for s in out.prompt_samples[len(prompt) + shared - 1 :])
        return float("-inf")

    scores = await asyncio.gather(*(total(k, x) for k, x in enumerate(suffixes)))
    return names[max(range(len(names)), key=scores.__getitem__)]


def _forced_call(name: str, arguments: str) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}]


def _forced_reason(out: RequestOutput) -> str:
    return "tool_calls" if out.finish_reason == "stop" else out.finish_reason


def _may_be_call(text: str) -> bool:
    s = text.lstrip()
    return not s or any(s.startswith(p) or p.startswith(s) for p in CALL_STARTS)


def _tool_calls(text: str, names: set[str]) -> list[dict] | None:
    """OpenAI `tool_calls` when the whole output is calls to offered functions (`<tool_call>` blocks, a JSON
    object/list, the forms the tools prompt asks for, or the same in a ```json fence), else None."""
    if not text.lstrip().startswith(CALL_STARTS) or not only_calls(text):
        return None
    calls = parse_calls(text)
    if not calls or not all(next(iter(c)) in names for c in calls):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}} for c in calls for name, args in c.items()]


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _render_chat(api: Api, messages: list, tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
    """Messages -> prompt token ids with the model's chat template. Templates without a tools section get
    the tools as the system prompt that `quantkit eval` uses, and earlier assistant calls as <tool_call> text."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list", param="messages")
    tok = api.tokenizer
    native = bool(tools) and "tools" in (tok.chat_template or "")
    msgs = [_message(m, native) for m in messages]
    if tools and not native:
        system = SYSTEM_PROMPT.format(tools=json.dumps([t["function"] for t in tools], indent=1))
        if msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": system + "\n\n" + msgs[0]["content"]}
        else:
            msgs.insert(0, {"role": "system", "content": system})
    try:
        text = tok.apply_chat_template(msgs, tools=tools if native else None, add_generation_prompt=add_generation_prompt,
                                       tokenize=False)
    except Exception as e:  # noqa: BLE001  the template's own complaint (e.g. roles must alternate)
        raise ApiError(400, f"chat template: {e}", param="messages") from None
    return tok(text, add_special_tokens=False)["input_ids"]


def _message(m: Any, native_tools: bool) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, "each message needs a string `role`", param="messages")
    if m["role"] not in ROLES:
        raise ApiError(400, f"unknown message role {m['role']!r}: use one of {', '.join(ROLES)}", param="messages")
    if m["role"] == "developer":  # OpenAI's newer name for the system role; chat templates know only "system"
        m = {**m, "role": "system"}
    content = m.get("content")
    if content is None and m["role"] != "assistant":  # (an assistant's may be null: it made tool calls)
        raise ApiError(400, f"a {m['role']} message needs `content`", param="messages")
    if isinstance(content, list):  # content parts: only text is understood
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        content = "".join(p.get("text", "") for p in content)
    elif content is not None and not isinstance(content, str):
        raise ApiError(400, "message content must be a string or a list of text parts", param="messages")
    out = {**m, "content": content or ""}
    calls = m.get("tool_calls") or []
    if calls and not native_tools:
        try:
            text = [f'<tool_call>{json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})}</tool_call>'
                    for c in calls]
        except (KeyError, TypeError):
            raise ApiError(400, "tool_calls entries need function.name and function.arguments", param="messages") from None
        out = {"role": m["role"], "content": "\n".join(filter(None, [out["content"], *text]))}
    return out


def _arguments(call: dict) -> Any:
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


# --- helpers ------------------------------------------------------------------------------------
def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
        except (ApiError, EngineError) as e:  # headers are out already: the error travels as an event
            status = getattr(e, "status", 500)
            yield f"data: {json.dumps(error_body(str(e), 'server_error' if status >= 500 else 'invalid_request_error', status))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(raw: Request) -> None:
    """Returns when the client has gone away (the body is read already, so the next message is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _generation_defaults(path) -> dict:
    """Sampling defaults from the checkpoint's generation_config.json, as HF and vLLM use them."""
    gen = path / "generation_config.json"
    if not gen.exists():
        return {}
    cfg = json.loads(gen.read_text())
    return {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if cfg.get(k) is not None}
