"""Weights in the kernels' layout, kept on disk from one start of a checkpoint to the next.

Laying a checkpoint out for the panel GEMM is a copy of every quantized weight and of a tied bf16 head: for the
1.5B Qwen that is 1.2 GB of fresh memory, half a second of a 2.5 s start, and the same bytes every time. The first
start writes them to one file in the cache; later starts map that file (no copy: the page cache is the memory)
and skip the checkpoint's packed words altogether.

An entry is keyed by the checkpoint (its resolved path, and each weight file's and config.json's size and mtime),
the layout's settings (dtype, kernel, head) and the source of the code that makes the layout, so a changed
checkpoint or a changed layout never reads a stale entry. Entries are written whole or not at all; the least
recently used are removed beyond `QUANTKIT_PANEL_CACHE_GB` (default 8). `QUANTKIT_PANEL_CACHE=0` turns it off; a
directory there puts it elsewhere than quantkit's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from quantkit.formats import safetensors_file
from quantkit.formats.load import read_tensors

FILE = "panels.safetensors"
MIN_BYTES = 32 << 20  # smaller layouts are made faster than they are read back: not kept
ALIGN = 64  # kernels load whole cache lines from the panels
LAYOUT_SOURCES = ("runtime/layers/linear.py", "runtime/layers/panel_cache.py", "formats/pack.py", "kernels/csrc/fused.cpp")


class PanelCache:
    """`get(name, make)`: the cached tensor if this checkpoint's entry has it, else `make()` (remembered for `save`)."""

    def __init__(self, entry: Path | None, min_bytes: int = MIN_BYTES):
        self.entry, self.min_bytes = entry, min_bytes
        self.found: dict[str, Tensor] = {}
        self.made: dict[str, Tensor] = {}
        if entry is not None and (entry / FILE).is_file():
            try:
                self.found = read_tensors(entry)  # mapped, not read: pages come in as the kernels touch them
            except Exception:  # a damaged entry is made again, never trusted
                self.found = {}
            try:
                os.utime(entry)  # recently used
            except OSError:
                pass

    @classmethod
    def of(cls, checkpoint: Path, settings: dict, min_bytes: int = MIN_BYTES) -> PanelCache:
        where = os.environ.get("QUANTKIT_PANEL_CACHE", "")
        if where == "0":
            return cls(None)
        from quantkit.models import cache_dir, weight_files

        root = Path(__file__).resolve().parents[2]
        files = weight_files(checkpoint) + [checkpoint / "config.json"]
        key = hashlib.sha256(json.dumps({
            "checkpoint": str(checkpoint.resolve()),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "settings": settings,
            "layout": hashlib.sha256(b"".join((root / s).read_bytes() for s in LAYOUT_SOURCES)).hexdigest(),
        }, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return cls((Path(where) if where not in ("", "1") else cache_dir() / "panels") / key, min_bytes)

    @property
    def hit(self) -> bool:
        return bool(self.found) and not self.made

    def get(self, name: str, make: Callable[[], Tensor]) -> Tensor:
        t = self.found.get(name)
        if t is None:
            t = make()
            if self.entry is not None:
                self.made[name] = t
        return t

    def save(self) -> None:
        """Write the entry when anything was made (whole, then renamed into place), then trim the cache."""
        if self.entry is None or not self.made:
            return
        tensors = {**self.found, **self.made}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size < self.min_bytes or any(t.numel() * t.element_size() % ALIGN for t in tensors.values()):
            return
        tmp = self.entry.with_name(f".{self.entry.name}.tmp-{os.getpid()}")
        try:
            self.entry.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.entry.parent).free < 2 * size:
                print(f"quantkit: not keeping the weights' kernel layout ({size / 2**30:.1f} GB): too little free disk",
                      file=sys.stderr)
                return
            print(f"quantkit: keeping the weights' kernel layout for faster starts ({size / 2**30:.2f} GB, once per "
                  "checkpoint; QUANTKIT_PANEL_CACHE=0 turns this off)", file=sys.stderr, flush=True)
            tmp.mkdir(parents=True, exist_ok=True)
            safetensors_file.write(tmp / FILE, tensors, ALIGN)
            shutil.rmtree(self.entry, ignore_errors=True)  # a damaged or partial entry
            try:
                tmp.rename(self.entry)
            except OSError:
                if not (self.entry / FILE).is_file():
                    raise  # (else another process loading this checkpoint kept it first)
        except OSError as e:  # a read-only or full cache costs the next start its speed, never this one its model
            print(f"quantkit: could not keep the weights' kernel layout: {e}", file=sys.stderr)
            return
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        trim(self.entry.parent, keep=self.entry)


def trim(root: Path, keep: Path) -> None:
    """Remove the least recently used entries while the cache holds more than its limit (never `keep`)."""
    limit = float(os.environ.get("QUANTKIT_PANEL_CACHE_GB", "8")) * 2**30
    now = time.time()
    for e in root.iterdir():  # what a killed writer left behind
        if e.name.startswith(".") and now - e.stat().st_mtime > 3600:
            shutil.rmtree(e, ignore_errors=True)
    entries = [e for e in root.iterdir() if e.is_dir() and not e.name.startswith(".")]
    sizes = {e: sum(f.stat().st_size for f in e.iterdir()) for e in entries}
    total = sum(sizes.values())
    for e in sorted(entries, key=lambda e: e.stat().st_mtime):
        if total <= limit:
            break
        if e != keep:
            shutil.rmtree(e, ignore_errors=True)
            total -= sizes[e]
