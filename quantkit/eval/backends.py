"""The one small interface evals talk to a model through: chat prompts, token counts, logits, greedy generation.

`RuntimeBackend` (the default) runs a dense or compressed-tensors checkpoint in quantkit's own decode
runtime, what `quantkit serve` serves; `HFBackend` runs it in HF transformers, the cross-check; both load
the model only when first asked for logits or text, so a fully cached baseline never loads.
`EndpointBackend` sends the same prompts to any OpenAI-compatible server (vLLM, `quantkit serve`). All
format prompts with the model's own tokenizer and chat template, so every backend sees byte-identical prompts.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from quantkit import QuantkitError


class TokenizerMixin:
    """Prompt formatting and token counting from the model's own tokenizer."""
    tokenizer = None

    def _load_tokenizer(self, path: Path) -> None:
        from transformers import AutoTokenizer

        from quantkit.models import quiet_transformers

        with quiet_transformers():
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        kwargs = {"tools": tools} if tools and self.supports_tools else {}
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        # a base model (no template): the messages as plain text, after the BOS its tokenizer puts before any text
        # (Gemma's <bos>; prompts are encoded without special tokens, so it is written here as a template would)
        bos = self.tokenizer.bos_token if self.tokenizer("x")["input_ids"][:1] == [self.tokenizer.bos_token_id] else None
        return (bos or "") + "\n".join(m["content"] for m in messages) + "\n"

    @property
    def supports_tools(self) -> bool:
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return "tools" in template


def _context_length(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


class HFBackend(TokenizerMixin):
    """HF transformers on CPU (or CUDA), greedy decoding, batches sorted by length with left padding.

    bf16 by default: the dtype these checkpoints are served in, and ~2.5x faster than fp32 on CPUs with
    AVX512-BF16. Logits are compared in float32."""

    kind = "hf"

    def __init__(self, path: Path, name: str, dtype: torch.dtype = torch.bfloat16, batch_size: int = 8):
        self.name, self.path, self.dtype, self.batch_size = name, path, dtype, batch_size
        self._model = None
        self._load_tokenizer(path)
        self.context_length = _context_length(path)

    @property
    def identity(self) -> dict:
        """What this backend's results depend on besides the inputs (for the result cache)."""
        from quantkit.eval.cache import model_hash

        return {"model": model_hash(self.path), "backend": self.kind, "dtype": str(self.dtype), "batch": self.batch_size}

    @property
    def model(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM

            from quantkit.models import _no_tqdm, quiet_transformers

            # compressed-tensors draws bars of its own while loading and on the first forward, when it
            # decompresses: run that forward here, silenced.
            with quiet_transformers(), _no_tqdm(), torch.no_grad():
                self._model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).eval()
                self._model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self._model.device), use_cache=False)
        return self._model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def logits(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids.to(self.device), use_cache=False).logits

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


class RuntimeBackend(TokenizerMixin):
    """quantkit's own decode runtime: greedy generation with continuous batching and the prefix cache (tool
    prompts share their long system and tools preamble), logits from a prefill. The engine is built on first
    use, so a baseline whose results all come from the cache never loads."""

    kind = "runtime"

    def __init__(self, path: Path, name: str, dtype: str = "bf16", kv_cache_memory: int = 1 << 30):
        self.name, self.path, self.dtype, self.kv_cache_memory = name, path, dtype, kv_cache_memory
        self._engine = None
        self._load_tokenizer(path)
        self.context_length = _context_length(path)

    @property
    def engine(self):
        if self._engine is None:
            from quantkit.runtime import EngineConfig, LLMEngine

            self._engine = LLMEngine(self.path, EngineConfig(dtype=self.dtype, kv_cache_memory=self.kv_cache_memory),
                                     tokenizer=self.tokenizer)
        return self._engine

    @property
    def identity(self) -> dict:
        from quantkit.eval.cache import model_hash

        return {"model": model_hash(self.path), "backend": self.kind, "dtype": self.dtype}

    def logits(self, ids: Tensor) -> Tensor:
        """ids [b, seq] -> [b, seq, vocab] float32, one sequence at a time through the engine's prefill."""
        engine = self.engine
        bs, out = engine.cfg.block_size, []
        for row in ids:
            if -(-len(row) // bs) > engine.cache.num_blocks:
                raise QuantkitError(f"a row of {len(row)} tokens does not fit the runtime's KV cache")
            out.append(engine.model(engine.single(row, all_logits=True), engine.cache))
        return torch.stack(out)

    def generate(self, prompts: list[str], max_new_tokens: int, on_item=None) -> list[str]:
        from quantkit.runtime import SamplingParams

        engine = self.engine
        params = SamplingParams(max_tokens=max_new_tokens)
        ids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.id] = out.text
                    if on_item:
                        on_item()
        return [done[i] for i in ids]


class EndpointBackend(TokenizerMixin):
    """A model behind an OpenAI-compatible server, reached through `POST {url}/completions`.

    Prompts are formatted here with the tokenizer of `path` (the checkpoint being served) and sent as raw
    completions, temperature 0, so the server applies no template of its own and both sides of a
    comparison see the same text. Requests run `concurrency` at a time so the server can batch them.
    Distribution metrics need full logits, which these APIs do not return: only generation tasks run here.
    """

    kind = "endpoint"

    def __init__(self, url: str, path: Path, name: str, model: str | None = None, api_key: str | None = None,
                 concurrency: int = 8, timeout: float = 600.0):
        self.url, self.path, self.name = url.rstrip("/"), path, name
        self.api_key, self.concurrency, self.timeout = api_key, concurrency, timeout
        self._load_tokenizer(path)
        self.context_length = _context_length(path)
        self.model_name = model or self._served_model()

    @property
    def identity(self) -> dict:
        return {"endpoint": self.url, "model": self.model_name}

    def _request(self, method: str, route: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}{route}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise QuantkitError(f"endpoint {self.url}{route} answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise QuantkitError(f"endpoint {self.url}{route} unreachable or not OpenAI-compatible: {e}") from None

    def _served_model(self) -> str:
        models = self._request("GET", "/models").get("data") or []
        if not models:
            raise QuantkitError(f"endpoint {self.url} serves no model (GET /models is empty)")
        return models[0]["id"]

    def logits(self, ids: Tensor) -> Tensor:
        raise QuantkitError("ppl and kl need full logits, which an endpoint does not return: use --tasks retrieval,tool-use")

    def generate(self, prompts: list[str], max_new_tokens: int, on_item=None) -> list[str]:
        def one(prompt: str) -> str:
            # the prompt is text as the chat template rendered it (its BOS included where the template writes one):
            # the server adds no other special token (vLLM's and quantkit's /completions would add a BOS by default)
            body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0,
                    "add_special_tokens": False}
            reply = self._request("POST", "/completions", body)
            text = reply["choices"][0]["text"]
            if on_item:
                on_item()
            return text

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(one, prompts))
