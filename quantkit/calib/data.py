"""Calibration data: text from a hub dataset, a local file, or the built-in offline corpus -> token rows.

The built-in corpus is Python's own reference documentation (`pydoc_data.topics`, ~465 KB of English
that every Python install carries). It is cut deterministically into blocks of whole paragraphs of about
2,000 characters; every 5th block is held out for evaluation and the rest is for calibration, so quantkit
never calibrates on the text it later measures perplexity on.

BOS: each row starts with the tokenizer's BOS token when the tokenizer itself adds one on encoding
(Llama 3, Mistral); tokenizers that add none (SmolLM2, Qwen) get none, matching how the model is run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from quantkit import QuantkitError

BUILTIN = "builtin"
HELD_OUT_EVERY = 5
BLOCK_CHARS = 2000


@dataclass(slots=True)
class CalibConfig:
    """Where calibration text comes from and how much of it: `samples` rows of `seqlen` tokens."""

    source: str = BUILTIN  # "builtin" | local .txt/.jsonl/.json/.parquet | hub dataset name
    samples: int = 128
    seqlen: int = 512
    seed: int = 0
    split: str = "train"
    column: str = "text"
    chat_template: bool = False  # format conversational rows ("messages") with the model's chat template


@dataclass(slots=True)
class CalibSet:
    ids: Tensor  # [samples, seqlen] int64
    bos: bool  # whether each row starts with BOS
    warnings: list[str]

    def describe(self) -> str:
        n, l = self.ids.shape
        return f"{n} x {l} tokens, {'BOS prepended' if self.bos else 'no BOS (the tokenizer adds none)'}"


def builtin_texts(part: str) -> list[str]:
    """The built-in corpus as text blocks: `part` = "calib" (4 in 5 blocks) or "eval" (every 5th)."""
    from pydoc_data.topics import topics

    blocks, current = [], ""
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            current = f"{current}\n\n{para}" if current else para
            if len(current) >= BLOCK_CHARS:
                blocks.append(current)
                current = ""
    blocks.append(current)
    held = [b for i, b in enumerate(blocks) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    if part == "eval":
        return held
    seen = set(held)  # the docs repeat a few passages verbatim: never calibrate on held-out text
    return [b for i, b in enumerate(blocks) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1 and b not in seen]


TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")


def load_texts(cfg: CalibConfig, tokenizer=None) -> list[str]:
    if cfg.source == BUILTIN:
        return builtin_texts("calib")
    path = Path(cfg.source).expanduser()
    if path.exists():
        return _file_texts(path, cfg, tokenizer)
    if path.suffix.lower() in TEXT_SUFFIXES or cfg.source.startswith((".", "/", "~")):  # a file, not a dataset name
        raise QuantkitError(f"text file not found: {cfg.source}")
    return _hub_texts(cfg, tokenizer)


def _file_texts(path: Path, cfg: CalibConfig, tokenizer) -> list[str]:
    suffix = path.suffix.lower()
    try:
        if suffix in (".txt", ".md", ""):
            return [path.read_text()]
        if suffix in (".jsonl", ".json"):
            lines = path.read_text().splitlines() if suffix == ".jsonl" else None
            rows = [json.loads(x) for x in lines if x.strip()] if lines is not None else json.loads(path.read_text())
            return [_row_text(r, cfg, tokenizer, f"{path}:{i + 1}") for i, r in enumerate(rows)]
        if suffix == ".parquet":
            import datasets

            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
            return [_row_text(r, cfg, tokenizer, f"{path} row {i}") for i, r in enumerate(ds)]
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise QuantkitError(f"cannot read text file {path}: {str(e).splitlines()[0]}") from e
    raise QuantkitError(f"text file {path}: use .txt, .jsonl, .json or .parquet")


def _hub_texts(cfg: CalibConfig, tokenizer) -> list[str]:
    import datasets

    name, _, subset = cfg.source.partition(":")
    try:
        ds = datasets.load_dataset(name, subset or None, split=cfg.split)
    except Exception as e:  # offline, unknown dataset, bad split: one line
        raise QuantkitError(
            f"cannot load dataset {cfg.source!r} (split {cfg.split}): {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}; use the built-in text or a local file"
        ) from e
    rows = ds.shuffle(seed=cfg.seed).select(range(min(len(ds), cfg.samples * 8)))
    return [_row_text(r, cfg, tokenizer, f"{cfg.source} row {i}") for i, r in enumerate(rows)]


def _row_text(row, cfg: CalibConfig, tokenizer, where: str) -> str:
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        raise QuantkitError(f"{where}: expected an object with a {cfg.column!r} or 'messages' field")
    if "messages" in row and (cfg.chat_template or cfg.column not in row):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise QuantkitError(f"{where}: conversational rows need a tokenizer with a chat template")
        return tokenizer.apply_chat_template(row["messages"], tokenize=False)
    if cfg.column not in row or not isinstance(row[cfg.column], str):
        raise QuantkitError(f"{where}: no text column {cfg.column!r} (set --calib-column)")
    return row[cfg.column]


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def build(cfg: CalibConfig, tokenizer) -> CalibSet:
    """Token rows [samples, seqlen]: texts joined by EOS into one stream, cut into rows, shuffled by seed."""
    if cfg.samples < 1 or cfg.seqlen < 8:
        raise QuantkitError("--calib-samples must be at least 1 and --calib-seqlen at least 8")
    if tokenizer is None:
        raise QuantkitError("calibration needs a tokenizer, and the model directory has none")
    texts = [t for t in load_texts(cfg, tokenizer) if t.strip()]
    if not texts:
        raise QuantkitError(f"calibration source {cfg.source!r} has no text")
    stream = _stream(texts, tokenizer)
    rows = _rows(stream, cfg.seqlen, tokenizer, cfg.seed)
    warnings = []
    if not rows:
        raise QuantkitError(f"calibration text has {len(stream)} tokens, fewer than one row of {cfg.seqlen}")
    if len(rows) < cfg.samples:
        warnings.append(f"calibration text gives only {len(rows)} rows of {cfg.seqlen} tokens (asked {cfg.samples})")
    rows = rows[: cfg.samples]
    if len(rows) < 16 or cfg.seqlen < 128:
        warnings.append(
            f"a small calibration set ({len(rows)} x {cfg.seqlen} tokens): GPTQ/AWQ results may be noisy; "
            "128 x 512 or more is typical"
        )
    return CalibSet(torch.tensor(rows, dtype=torch.long), adds_bos(tokenizer), warnings)


def eval_rows(tokenizer, seqlen: int, max_rows: int | None = None, source: str = BUILTIN, split: str = "test",
              column: str = "text") -> Tensor:
    """Held-out text as [rows, seqlen] token ids, in order (for perplexity): the built-in corpus's held-out
    blocks, or any text source `--calib` accepts (a local file, a datasets name)."""
    if source == BUILTIN:
        texts = builtin_texts("eval")
    else:
        texts = load_texts(CalibConfig(source=source, split=split, column=column, samples=max_rows or 64), tokenizer)
    rows = _rows(_stream(texts, tokenizer), seqlen, tokenizer)
    if not rows:
        raise QuantkitError(f"{source}: too little text for one row of {seqlen} tokens")
    return torch.tensor(rows[:max_rows] if max_rows else rows, dtype=torch.long)


def _stream(texts: list[str], tokenizer) -> list[int]:
    """Texts tokenized without special tokens, joined by EOS."""
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + sep
    return stream


def _rows(stream: list[int], seqlen: int, tokenizer, seed: int | None = None) -> list[list[int]]:
    """Cut the stream into rows of seqlen (BOS first where the tokenizer adds one); shuffled if seeded."""
    bos = adds_bos(tokenizer)
    body = seqlen - int(bos)
    rows = [stream[i : i + body] for i in range(0, len(stream) - body + 1, body)]
    if seed is not None:
        random.Random(seed).shuffle(rows)
    return [[tokenizer.bos_token_id, *r] for r in rows] if bos else rows
