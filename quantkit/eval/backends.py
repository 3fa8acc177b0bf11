"""The one small interface evals talk to a model through: logits, batched greedy generation, token counts.

`HFBackend` runs a dense or compressed-tensors checkpoint in HF transformers; the bundled runtime and
OpenAI-compatible endpoints will sit behind the same three methods.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor


class HFBackend:
    """HF transformers on CPU (or CUDA), greedy decoding, batches sorted by length with left padding.

    bf16 by default: the dtype these checkpoints are served in, and ~2.5x faster than fp32 on CPUs with
    AVX512-BF16. Logits are compared in float32."""

    def __init__(self, path: Path, name: str, dtype: torch.dtype = torch.bfloat16, batch_size: int = 8):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from quantkit.models import _no_tqdm, _quiet_transformers

        self.name, self.path, self.batch_size = name, path, batch_size
        with _quiet_transformers(), _no_tqdm():  # compressed-tensors draws its own bars while loading
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = next(self.model.parameters()).device

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def logits(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids.to(self.device), use_cache=False).logits

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        kwargs = {"tools": tools} if tools and self.supports_tools else {}
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return "\n".join(m["content"] for m in messages) + "\n"

    @property
    def supports_tools(self) -> bool:
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return "tools" in template

    @torch.no_grad()
    def generate(self, prompts: list[str], max_new_tokens: int, on_item=None) -> list[str]:
        """Greedy completions of already-formatted prompts, batched by length (longest first)."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[str] = [""] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            enc = self.tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            gen = self.model.generate(**enc.to(self.device), max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id, max_length=None)
            for j, i in enumerate(idx):
                out[i] = self.tokenizer.decode(gen[j, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                if on_item:
                    on_item()
        return out
