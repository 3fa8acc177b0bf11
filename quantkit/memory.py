"""Peak resident memory of this process, for the summaries and the memory benchmarks."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 16 << 20


def peak_rss_bytes() -> int:
    """High-water resident set size. On Linux this is VmHWM, which starts afresh at exec; getrusage's
    ru_maxrss would carry over the high-water mark of the process that forked us."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: rare path


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at 16 MiB: larger allocations get their own mapping, returned on free.

    By default glibc moves that threshold up after each large free, so the layer-sized tensors a layer
    walk allocates and frees end up on the heap and its fragments stay resident. Fixing it keeps peak
    memory near one layer. 16 MiB rather than lower: each mapped allocation costs fresh page faults, and
    at 1 MiB GPTQ on SmolLM2 ran 25% slower (activations are a few MiB each). A no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass
