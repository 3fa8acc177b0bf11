"""Peak resident memory of this process, for the summaries and the memory benchmarks."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter numbers


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
    """Make glibc serve every allocation of 1 MiB or more with its own mmap, returned to the OS on free.

    By default glibc raises that threshold after the first large free (up to 32 MiB), so the layer-sized
    tensors a layer walk allocates and frees land on the heap and stay resident; peak memory then grows
    with the number of layers instead of staying at about one layer. A no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass
