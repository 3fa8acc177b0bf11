"""Baseline results on disk, keyed by the model's content hash and the task's exact inputs.

Evaluating several quantized variants of one model repeats the same baseline work; with this cache only
the first run pays for it. A key covers everything the result depends on (weights, dtype, backend, the
prompts or token rows, generation length, and `VERSION`, bumped whenever scoring inputs change), so a hit
is always the result a fresh run would give. Entries are written atomically; a corrupt or unreadable entry
is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from quantkit.formats.save import atomic_file
from quantkit.models import cache_dir, source_hash, weight_files

VERSION = 1


def model_hash(path: Path) -> str:
    """sha256 of a model's weight files and config, remembered per (file, size, mtime) so reruns skip the read."""
    files = weight_files(path) + [path / "config.json"]
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    index = cache_dir() / "eval" / "hashes.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp in known:
        return known[stamp]
    digest = source_hash(files)
    known[stamp] = digest
    atomic_file(index, lambda tmp: tmp.write_text(json.dumps(known)))
    return digest


def key(**parts: Any) -> str:
    """A stable key for a result: sha256 over the JSON of its inputs."""
    return hashlib.sha256(json.dumps({"version": VERSION, **parts}, sort_keys=True, default=str).encode()).hexdigest()


def digest_of(texts: list[str]) -> str:
    """Short identity of a long input (the prompts) for a key."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


class ResultCache:
    """get/put of torch-serializable results under `root`; disabled, it stores nothing and finds nothing."""

    def __init__(self, enabled: bool = True):
        self.root = cache_dir() / "eval" / "results"
        self.enabled = enabled
        self.hits: list[str] = []

    def get(self, k: str, label: str) -> Any | None:
        path = self.root / f"{k}.pt"
        if not self.enabled or not path.exists():
            return None
        try:
            value = torch.load(path, weights_only=True)
        except Exception:  # a truncated or foreign file: recompute
            return None
        self.hits.append(label)
        return value

    def put(self, k: str, value: Any) -> None:
        if self.enabled:
            atomic_file(self.root / f"{k}.pt", lambda tmp: torch.save(value, tmp))
