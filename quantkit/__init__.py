"""quantkit: quantize LLMs to compressed-tensors checkpoints, measure the cost, serve them."""

import time

__version__ = "0.1.0"
_IMPORTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started (from /proc on Linux; elsewhere since quantkit was imported), for the
    "ready in N s" lines that measure start-up as a user sees it."""
    try:
        import os

        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class QuantkitError(Exception):
    """An expected failure the user can act on: the CLI prints its message as one line and exits 2."""


def __getattr__(name: str):
    """`from quantkit import LLM, SamplingParams` without importing torch for every `import quantkit`."""
    if name in ("LLM", "SamplingParams", "EngineConfig", "LLMEngine"):
        from quantkit import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
