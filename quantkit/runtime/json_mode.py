"""JSON mode: constrain generation to one JSON object (`response_format: {"type": "json_object"}`).

`JsonPrefix` is a character-level pushdown automaton that says whether a text can still grow into valid
JSON; `choose` walks the candidates from the most likely down and takes the first (greedy) or samples
among the first few hundred whose text keeps the prefix valid. Once the object is complete, the next
token is EOS. Runs of whitespace outside strings are capped, so a small model cannot pad forever.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from quantkit.runtime.sampler import (
    Sample,
    SamplingParams,
    filter_logits,
    penalize,
    scored,
)

MAX_SPACES = 4  # consecutive whitespace characters allowed between tokens of the JSON
CANDIDATES = 512  # tokens examined per step before falling back to the whole vocabulary
WS = " \t\n\r"
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")


@dataclass(frozen=True, slots=True)
class JsonPrefix:
    stack: tuple[str, ...] = ()  # open containers: "{" or "["
    mode: str = "value"  # value | first_value | key | first_key | colon | after | string | number | literal | done
    key: bool = False  # the open string is an object key
    escape: int = 0  # inside a string: 1 after a backslash, 2-5 inside \\uXXXX
    number: str = ""  # the number so far
    literal: str = ""  # the rest of true / false / null still to come
    spaces: int = 0

    @property
    def complete(self) -> bool:
        return self.mode == "done"  # the top level is an object, so only its closing brace completes it

    def feed(self, text: str) -> JsonPrefix | None:
        """The state after `text`, or None if no valid JSON object starts with what came so far plus it."""
        state: JsonPrefix | None = self
        for ch in text:
            state = state._step(ch)
            if state is None:
                return None
        return state

    def _step(self, ch: str) -> JsonPrefix | None:
        m = self.mode
        if m == "string":
            if self.escape == 1:
                if ch == "u":
                    return replace(self, escape=2)
                return replace(self, escape=0) if ch in '"\\/bfnrt' else None
            if self.escape >= 2:
                if ch not in "0123456789abcdefABCDEF":
                    return None
                return replace(self, escape=0 if self.escape == 5 else self.escape + 1)
            if ch == "\\":
                return replace(self, escape=1)
            if ch == '"':
                return replace(self, mode="colon" if self.key else "after", key=False, spaces=0)
            return self if ch >= " " else None
        if m == "number":
            if _number_grows(self.number + ch):
                return replace(self, number=self.number + ch)
            if not _number_ends(self.number):
                return None
            return replace(self, mode="after", number="")._step(ch)  # numbers only stand inside the object
        if m == "literal":
            if ch != self.literal[0]:
                return None
            rest = self.literal[1:]
            return replace(self, literal=rest) if rest else replace(self, mode="after", literal="")
        if ch in WS:
            return replace(self, spaces=self.spaces + 1) if self.spaces < MAX_SPACES and m != "done" else None
        s = replace(self, spaces=0)
        if m in ("value", "first_value"):
            if not self.stack and ch != "{":
                return None  # json_object: the top level is an object
            if m == "first_value" and ch == "]":
                return s._close("[")
            if ch == "{":
                return replace(s, stack=(*self.stack, "{"), mode="first_key")
            if ch == "[":
                return replace(s, stack=(*self.stack, "["), mode="first_value")
            if ch == '"':
                return replace(s, mode="string", key=False)
            if ch in "-0123456789":
                return replace(s, mode="number", number=ch)
            if ch in LITERALS:
                return replace(s, mode="literal", literal=LITERALS[ch])
            return None
        if m in ("key", "first_key"):
            if ch == '"':
                return replace(s, mode="string", key=True)
            return s._close("{") if m == "first_key" and ch == "}" else None
        if m == "colon":
            return replace(s, mode="value") if ch == ":" else None
        if m == "after":
            top = self.stack[-1]
            if ch == ",":
                return replace(s, mode="key" if top == "{" else "value")
            return s._close(top) if ch == ("}" if top == "{" else "]") else None
        return None  # done: nothing may follow

    def _close(self, bracket: str) -> JsonPrefix | None:
        if not self.stack or self.stack[-1] != bracket:
            return None
        stack = self.stack[:-1]
        return replace(self, stack=stack, mode="after" if stack else "done")


def _number_ends(text: str) -> bool:
    return NUMBER.fullmatch(text) is not None


def _number_grows(text: str) -> bool:
    """Whether `text` is a prefix of a JSON number: every proper prefix ends in '-', '.', 'e', 'E', '+' or a
    digit, and one more digit completes it."""
    return _number_ends(text) or _number_ends(text + "0")


def choose(logits: Tensor, p: SamplingParams, seen: list[int], generator: torch.Generator | None, state: JsonPrefix,
           piece, eos: int) -> tuple[Sample, JsonPrefix]:
    """The next token under the JSON constraint: logits [vocab] float32 -> (sample, new state)."""
    logprobs = logits.log_softmax(-1)
    if state.complete:
        return scored(logprobs, eos, p.logprobs), state
    adjusted = penalize(logits, seen, p.repetition_penalty)
    weights = adjusted if p.greedy else filter_logits(adjusted, p).softmax(-1)
    ok: list[tuple[int, JsonPrefix, float]] = []
    for limit in (CANDIDATES, weights.numel()):
        values, ids = weights.topk(min(limit, weights.numel()))
        for w, t in zip(values.tolist(), ids.tolist()):
            if (p.greedy or w > 0) and (nxt := _after(state, piece(t))) is not None:
                ok.append((t, nxt, w))
                if p.greedy:
                    break
        if ok:
            break
    if not ok:  # nothing can continue the JSON (not with a byte-level vocabulary): end here
        return scored(logprobs, eos, p.logprobs), state
    if p.greedy:
        token, nxt, _ = ok[0]
    else:
        w = torch.tensor([w for _, _, w in ok])
        token, nxt, _ = ok[int(torch.multinomial(w / w.sum(), 1, generator=generator))]
    return scored(logprobs, token, p.logprobs), nxt


def _after(state: JsonPrefix, text: str) -> JsonPrefix | None:
    if not text or "\ufffd" in text:
        return None
    return state.feed(text)
