"""The OpenAI API's request bodies as pydantic models, and OpenAI-style error bodies.

Unknown fields are ignored (clients send vendor extras); a known field of the wrong type is a 400. Fields
accepted but not acted on are listed in `UNSUPPORTED` and refused when set to anything but their default,
rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    seed: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extensions: top_k, min_p, repetition_penalty, ignore_eos
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class CompletionRequest(Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    response_format: ResponseFormat | None = None  # vLLM's extension on completions
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # as vLLM: the tokenizer's BOS before a text prompt (Gemma's, Llama 3's)


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class ChatCompletionRequest(Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


# field -> its default: set to anything else, the request is refused with a 400 naming the field
UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "suffix": None}


def unsupported(req: Request) -> str | None:
    for name, default in UNSUPPORTED.items():
        if getattr(req, name, default) not in (default, {}):
            return name
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        return "best_of"
    return None


def error_body(message: str, kind: str = "invalid_request_error", code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
