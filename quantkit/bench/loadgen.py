"""A load generator for any OpenAI-compatible server, measuring what `vllm bench serve` measures, the same way.

Each request streams (`/v1/completions`, or `/v1/chat/completions` with `chat=True`); per request we
record when it was sent, when each chunk with text arrived, and the output token count from the
server's usage (or one per text chunk when the server reports none). Then, as vLLM defines them:
TTFT = first text chunk - send; TPOT = (latency - TTFT) / (output tokens - 1) per request; ITL = the
gaps between successive text chunks, pooled over requests; E2EL = the whole request.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from quantkit import QuantkitError


@dataclass(slots=True)
class LoadConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None  # default: the first of GET /v1/models
    concurrency: int | None = None  # at most this many requests in flight
    request_rate: float = float("inf")  # requests per second (Poisson arrivals); inf = all at once
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    prompts_file: Path | None = None  # JSONL of {"prompt": ...} (and optional "output_len")
    chat: bool = False
    ignore_eos: bool = True  # a fixed output length (vLLM's and llama.cpp's extension)
    api_key: str | None = None
    seed: int = 0
    timeout: float = 600.0


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(slots=True)
class Summary:
    concurrency: int | None
    request_rate: float
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]  # mean, p50, p90, p99
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = None if self.request_rate == float("inf") else self.request_rate
        return d


def base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise QuantkitError(f"{url}: give the server's URL, like http://127.0.0.1:8000")
    return url if url.endswith("/v1") else url + "/v1"


def random_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[tuple[str, int]]:
    """(text, token count) pairs of random tokens decoded to text, re-encoded and cut to `input_len`
    tokens, as vLLM's random dataset does, so prompt lengths hold in the server's own tokenizer."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        ids = tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"][:input_len]
        text = tokenizer.decode(ids)
        out.append((text, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return out


def file_prompts(path: Path, tokenizer) -> list[tuple[str, int, int | None]]:
    rows = []
    try:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                text = row["prompt"]
                rows.append((text, len(tokenizer(text, add_special_tokens=False)["input_ids"]), row.get("output_len")))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise QuantkitError(f"{path}: expected JSONL rows with a 'prompt' field ({type(e).__name__}: {e})") from None
    if not rows:
        raise QuantkitError(f"{path}: no prompts")
    return rows


async def discover_model(client, url: str) -> str:
    try:
        r = await client.get(url + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:
        raise QuantkitError(f"{url}/models: cannot read the served model ({type(e).__name__}: {e}); pass --model") from None


async def one_request(client, url: str, cfg: LoadConfig, model: str, prompt: str, prompt_len: int, max_tokens: int) -> RequestResult:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.chat:
        body["messages"], path = [{"role": "user", "content": prompt}], "/chat/completions"
    else:
        body["prompt"], path = prompt, "/completions"
    result = RequestResult(False, prompt_len)
    start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                usage = event.get("usage") or usage
                choices = event.get("choices") or []
                text = choices[0].get("text") if choices and not cfg.chat else (choices[0].get("delta") or {}).get("content") if choices else None
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = (usage or {}).get("completion_tokens") or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no text in the response"
    return result


async def run_load(cfg: LoadConfig, prompts: list[tuple[str, int, int]], progress: Callable[[], None] = lambda: None) -> Summary:
    import httpx

    url = base_url(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency or len(prompts), 1) + 4)
    async with httpx.AsyncClient(headers=headers, timeout=cfg.timeout, limits=limits) as client:
        model = cfg.model or await discover_model(client, url)
        gate = asyncio.Semaphore(cfg.concurrency or len(prompts))
        rng = random.Random(cfg.seed)

        async def limited(p):
            async with gate:
                r = await one_request(client, url, cfg, model, *p)
                progress()
                return r

        warm = await one_request(client, url, cfg, model, prompts[0][0], prompts[0][1], 4)
        if not warm.ok:
            raise QuantkitError(f"{url}: the warm-up request failed: {warm.error}")
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(cfg, results, duration)


def summarize(cfg: LoadConfig, results: list[RequestResult], duration: float) -> Summary:
    ok = [r for r in results if r.ok]
    stats = lambda xs: {"mean": float(np.mean(xs)) * 1e3 if xs else 0.0,
                        **{f"p{q}": float(np.percentile(xs, q)) * 1e3 if xs else 0.0 for q in (50, 90, 99)}}
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return Summary(cfg.concurrency, cfg.request_rate, len(ok), len(results) - len(ok), duration, in_tokens, out_tokens,
                   len(ok) / duration, out_tokens / duration, (in_tokens + out_tokens) / duration,
                   stats([r.ttft for r in ok]), stats(tpot), stats([g for r in ok for g in r.itl]), stats([r.latency for r in ok]),
                   errors)


def plot_sweep(summaries: list[Summary], path: Path, title: str) -> None:
    """Throughput against latency, one point per concurrency level (the curve to read a server's capacity from)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quantkit.formats.save import atomic_file

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "tpot_ms", "median TPOT (ms)"), (axes[1], "ttft_ms", "median TTFT (ms)")):
        xs = [s.output_throughput for s in summaries]
        ys = [getattr(s, key)["p50"] for s in summaries]
        ax.plot(xs, ys, marker="o")
        for s, x, y in zip(summaries, xs, ys):
            ax.annotate(f"c={s.concurrency}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s (all requests)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    atomic_file(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
