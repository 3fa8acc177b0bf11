"""Measuring what quantization cost: perplexity now; KL, retrieval and tool use to come."""
