"""Long-context retrieval tasks generated from a seed, sized in the model's own tokens (after RULER).

Each item is a haystack of offline filler text (quantkit's held-out split of Python's reference docs)
with one or more needles inserted at a chosen depth, and a question. As in RULER, whose haystacks are one
set of essays, every item of one length reads the same filler: prompts then share everything up to their
needle, which a prefix cache computes once (run the deepest needles first and each later item prefills
only its needle and what follows). Scoring follows RULER's string
match: the fraction of expected strings that appear in the output (case-insensitive); an item counts
as correct when all of them do.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

TASKS = ("passkey", "niah_number", "niah_word", "niah_uuid", "niah_multikey", "niah_multivalue", "niah_multiquery",
         "variable_tracking", "json_kv")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
WORDS = ("apple", "river", "marble", "violet", "copper", "lantern", "meadow", "falcon", "pepper", "harbor", "velvet",
         "glacier", "thunder", "orchid", "saffron", "compass", "juniper", "canyon", "ember", "willow")


@dataclass(slots=True)
class Item:
    id: str
    task: str
    length: int  # target context length in tokens
    depth: float
    prompt: str
    answers: list[str]
    tokens: int = 0  # measured prompt length in tokens
    meta: dict = field(default_factory=dict)


def score(output: str, answers: list[str]) -> float:
    """RULER string_match_all: share of expected strings found in the output, case-insensitive."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


def _value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
    return str(uuid.UUID(int=rng.getrandbits(128)))


def _key(rng: random.Random) -> str:
    return "-".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(2))


def _needles(task: str, rng: random.Random) -> tuple[list[str], str, list[str]]:
    """(needle sentences, question, expected answers) for one item."""
    if task == "passkey":
        key = str(rng.randint(10_000, 99_999))
        return ([f"The pass key is {key}. Remember it. {key} is the pass key."],
                "What is the pass key? The pass key is", [key])
    if task.startswith("niah_") and task.split("_")[1] in ("number", "word", "uuid"):
        kind = task.split("_")[1]
        k, v = _key(rng), _value(kind, rng)
        return [f"One of the special magic {kind}s for {k} is: {v}."], \
            f"What is the special magic {kind} for {k} mentioned in the provided text? The special magic {kind} for {k} is", [v]
    if task == "niah_multikey":
        keys = [_key(rng) for _ in range(4)]
        values = [_value("number", rng) for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        return needles, f"What is the special magic number for {keys[0]} mentioned in the provided text? " \
                        f"The special magic number for {keys[0]} is", [values[0]]
    if task == "niah_multivalue":
        k = _key(rng)
        values = [_value("number", rng) for _ in range(3)]
        return [f"One of the special magic numbers for {k} is: {v}." for v in values], \
            f"What are all the special magic numbers for {k} mentioned in the provided text? The special magic numbers for {k} are", values
    if task == "niah_multiquery":
        keys = [_key(rng) for _ in range(3)]
        values = [_value("number", rng) for _ in keys]
        return [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)], \
            f"What are the special magic numbers for {', '.join(keys)} mentioned in the provided text? " \
            "The special magic numbers are", values
    if task == "variable_tracking":
        value = str(rng.randint(10_000, 99_999))
        names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(4)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        return chain, f"Find all variables that are assigned the value {value} in the text above. " \
                      f"Answer: the variables assigned the value {value} are", names
    raise ValueError(task)


def _json_pairs(n: int, rng: random.Random) -> list[str]:
    return [f'"{uuid.UUID(int=rng.getrandbits(128))}": "{uuid.UUID(int=rng.getrandbits(128))}"' for _ in range(n)]


class Filler:
    """Sentences of offline text, drawn in order from a seeded start, for haystacks."""

    def __init__(self, texts: list[str]):
        self.sentences = [s.strip() + "." for t in texts for s in t.replace("\n", " ").split(". ") if len(s.split()) > 3]

    def take(self, n_sentences: int, rng: random.Random) -> list[str]:
        start = rng.randrange(len(self.sentences))
        return [self.sentences[(start + i) % len(self.sentences)] for i in range(n_sentences)]


def build_item(task: str, length: int, depth: float, seed: int, count: Callable[[str], int], filler: Filler,
               haystack_seed: int | None = None) -> Item:
    """One item whose prompt is `length` tokens (within a few), needles at `depth` of the haystack. Items built
    with one `haystack_seed` and length read the same filler (else it follows `seed` too)."""
    rng = random.Random(f"{task}:{length}:{depth}:{seed}")
    hay = rng if haystack_seed is None else random.Random(f"haystack:{length}:{haystack_seed}")
    intro = "Some special information is hidden inside the following text. Read it and remember it.\n\n"
    if task == "json_kv":
        key, value = str(uuid.UUID(int=rng.getrandbits(128))), str(uuid.UUID(int=rng.getrandbits(128)))
        question = f'\n\nWhat is the value associated with the key "{key}" in the JSON object above? The value is'
        pairs = _json_pairs(max(1, length // 40), hay)  # a pair is about 50 tokens: more than enough
        prompt = _fit(pairs, [f'"{key}": "{value}"'], depth, intro + "{", question, length, count, joiner=", ", close="}")
        return Item(f"{task}-{length}-{int(depth * 100)}-{seed}", task, length, depth, prompt, [value], count(prompt))
    needles, question, answers = _needles(task, rng)
    question = "\n\n" + question
    budget = length - count(intro + " ".join(needles) + question)
    per_sentence = max(1, count(" ".join(filler.take(20, random.Random(0)))) // 20)
    sentences = filler.take(max(1, 2 * budget // per_sentence), hay)  # twice enough; _fit trims
    haystack = _fit(sentences, needles, depth, intro, question, length, count)
    return Item(f"{task}-{length}-{int(depth * 100)}-{seed}", task, length, depth, haystack, answers, count(haystack))


def _assemble(sentences: list[str], needles: list[str], depth: float, intro: str, question: str,
              joiner: str = " ", close: str = "") -> str:
    at = round(depth * len(sentences))
    return intro + joiner.join(sentences[:at] + needles + sentences[at:]) + close + question


def _fit(sentences, needles, depth, intro, question, length, count, joiner=" ", close="") -> str:
    """The most filler that keeps the prompt within `length` tokens (binary search on the count)."""
    lo, hi = 0, len(sentences)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(_assemble(sentences[:mid], needles, depth, intro, question, joiner, close)) <= length:
            lo = mid
        else:
            hi = mid - 1
    chosen = sentences[:lo]
    if lo < len(sentences) and joiner == " ":  # top up with the first words of the next sentence
        words = sentences[lo].split()
        a, b = 0, len(words)
        while a < b:
            mid = (a + b + 1) // 2
            if count(_assemble(chosen + [" ".join(words[:mid])], needles, depth, intro, question, joiner, close)) <= length:
                a = mid
            else:
                b = mid - 1
        if a:
            chosen = chosen + [" ".join(words[:a])]
    return _assemble(chosen, needles, depth, intro, question, joiner, close)


def generate(tasks: list[str], lengths: list[int], per_task: int, seed: int, count: Callable[[str], int],
             filler: Filler) -> list[Item]:
    """`per_task` items per task and length, one shared haystack per length, the depths cycled across tasks
    (so three items a task still cover all five depths). Ordered by length, deepest needle first: the order
    in which a prefix cache computes the shared haystack once."""
    items = []
    for t, task in enumerate(tasks):
        for length in lengths:
            for i in range(per_task):
                depth = DEPTHS[(t * per_task + i) % len(DEPTHS)]
                items.append(build_item(task, length, depth, seed + i, count, filler, haystack_seed=seed))
    return sorted(items, key=lambda it: (it.length, -it.depth))
