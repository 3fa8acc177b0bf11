"""quantkit: quantize LLMs to compressed-tensors checkpoints, measure the cost, serve them."""

__version__ = "0.1.0"


class QuantkitError(Exception):
    """An expected failure the user can act on: the CLI prints its message as one line and exits 2."""
