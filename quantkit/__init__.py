"""quantkit: quantize LLMs to compressed-tensors checkpoints, measure the cost, serve them."""

__version__ = "0.1.0"


class QuantkitError(Exception):
    """An expected failure the user can act on: the CLI prints its message as one line and exits 2."""


def __getattr__(name: str):
    """`from quantkit import LLM, SamplingParams` without importing torch for every `import quantkit`."""
    if name in ("LLM", "SamplingParams", "EngineConfig", "LLMEngine"):
        from quantkit import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
