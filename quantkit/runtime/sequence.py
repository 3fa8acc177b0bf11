"""One request as the engine tracks it: its tokens, how many are in the KV cache, and its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from quantkit.runtime.json_mode import JsonPrefix
from quantkit.runtime.sampler import Sample, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0  # engine step it arrived at (FIFO order)
    output: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    prompt_samples: list[Sample] = field(default_factory=list)  # prompt tokens 1.. scored, with prompt_logprobs
    computed: int = 0  # tokens whose keys/values are in the cache
    blocks: list[int] = field(default_factory=list)
    ring: int | None = None  # its ring in the sliding-window layers' cache (kv_cache.Ring), while it holds blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""  # detokenized output (kept up to date by the engine for stop strings)
    emitted: int = 0  # characters of `text` reported so far (a partial UTF-8 character waits for its rest)
    generator: torch.Generator | None = None
    json_state: JsonPrefix | None = None  # with params.json_object: the JSON written so far, as parser state
    draft: list[int] = field(default_factory=list)  # speculative tokens being verified this step (not yet output)
    draft_computed: int = 0  # with a draft model: tokens whose keys/values are in the draft's cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)
