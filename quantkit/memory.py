"""Peak resident memory of this process, for the summaries and the memory benchmarks."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 1 << 20
HEAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold on 64-bit


def peak_rss_bytes() -> int:
    """High-water resident set size. On Linux this is VmHWM, which starts afresh at exec; getrusage's
    ru_maxrss would carry over the high-water mark of the process that forked us."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: rare path


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at 1 MiB: larger allocations get their own mapping, returned on free.

    By default glibc moves that threshold up after each large free, so the tensors a layer walk allocates
    and frees end up on the heap and its fragments stay resident; peak memory then follows the
    allocator's luck (on the memory test's model: 50% to 107% of its dense size at a 16 MiB threshold,
    92% with activations on the heap, 33-44% at 1 MiB). The price is that every such allocation starts on
    fresh pages the kernel must zero: see `reuse_freed_memory` for where that price is too high.
    A no-op off glibc.
    """
    if (libc := _libc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


@contextmanager
def reuse_freed_memory() -> Iterator[None]:
    """Within the block, allocations up to 32 MiB come from the heap and reuse freed pages; after it,
    freed heap pages go back to the system and the 1 MiB threshold returns.

    Calibration forwards and GPTQ allocate and free megabyte-sized temporaries thousands of times per
    layer; on fresh mappings each one page-faults (GPTQ on SmolLM2: 18.5M minor faults, 41 s of kernel
    time, against 1.1M and 4 s on the heap). Trimming at the end of each block bounds the heap's
    fragments to what one block left behind, so peak memory stays about one layer plus its activations.
    """
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, HEAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.malloc_trim(0)


def trim_heap() -> None:
    """Give freed heap pages back now, inside a `reuse_freed_memory` block: before a step whose own peak adds to
    whatever the forwards before it left on the heap (GPTQ's solve of a down projection). A no-op off glibc."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)
