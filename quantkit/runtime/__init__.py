"""quantkit's decode runtime: continuous batching over a paged (optionally FP8) KV cache with INT4/INT8 weights."""

from quantkit.runtime.engine import LLM, EngineConfig, LLMEngine, RequestOutput
from quantkit.runtime.sampler import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
