"""Engine throughput and latency in-process, the same workload optionally run on HF `generate` and on
llama.cpp (llama-cpp-python) for a side-by-side table.

The workload is fixed by a seed: `batch` prompts of `input_len` tokens drawn from the built-in held-out
text, each generating exactly `output_len` tokens (EOS ignored), all submitted at once. Repeats draw fresh
prompts (seed + repeat), the same for every system, so no run is served from a prefix cache.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quantkit import QuantkitError


@dataclass(slots=True)
class Workload:
    batch: int
    input_len: int
    output_len: int
    seed: int = 0


@dataclass(slots=True)
class Result:
    system: str
    batch: int
    input_len: int
    output_len: int
    seconds: float  # whole workload, first request in to last token out
    ttft_s: float  # mean time to first token
    output_tok_s: float  # all output tokens / seconds
    decode_tok_s: float  # output tokens after the first of each request / time after the last first token
    prefill_tok_s: float  # prompt tokens / time until every request had its first token

    def to_dict(self) -> dict:
        return asdict(self)


def prompts_for(tokenizer, w: Workload) -> list[list[int]]:
    from quantkit.calib.data import builtin_texts

    text = " ".join(builtin_texts("eval"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if w.input_len >= len(ids):
        from quantkit import QuantkitError

        raise QuantkitError(f"--input-len {w.input_len}: the built-in text the prompts are cut from is {len(ids)} tokens")
    gen = torch.Generator().manual_seed(w.seed)
    starts = torch.randint(0, len(ids) - w.input_len, (w.batch,), generator=gen).tolist()
    return [ids[s : s + w.input_len] for s in starts]


def run_engine(engine, w: Workload, prompts: list[list[int]], label: str = "quantkit") -> Result:
    from quantkit.runtime.sampler import SamplingParams

    params = SamplingParams(max_tokens=w.output_len, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.id, time.perf_counter() - start)
    total = time.perf_counter() - start
    last_first = max(first.values())
    decode = w.batch * (w.output_len - 1) / max(total - last_first, 1e-9)
    return Result(label, w.batch, w.input_len, w.output_len, total, sum(first.values()) / len(first),
                  w.batch * w.output_len / total, decode, w.batch * w.input_len / last_first)


def run_hf(path: Path, w: Workload, prompts: list[list[int]], dtype: torch.dtype, tokenizer) -> Result:
    """HF `generate` on the same prompts as one left-padded batch, greedy, exactly output_len tokens."""
    from transformers import AutoModelForCausalLM

    from quantkit.models import _no_tqdm, quiet_transformers

    with quiet_transformers(), _no_tqdm():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        model(input_ids=torch.zeros(1, 1, dtype=torch.long))  # compressed-tensors decompresses on the first call
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id or 0)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=w.output_len, min_new_tokens=w.output_len, **kwargs)
    total = time.perf_counter() - start
    return Result("hf generate", w.batch, w.input_len, w.output_len, total, ttft, w.batch * w.output_len / total,
                  w.batch * (w.output_len - 1) / max(total - ttft, 1e-9), w.batch * w.input_len / ttft)


def run_llama_cpp(gguf: Path, w: Workload, prompts: list[list[int]], threads: int) -> Result:
    """llama.cpp through llama-cpp-python: one sequence at a time (its Python API does not batch requests)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise QuantkitError("--llama-cpp needs llama-cpp-python (pip install llama-cpp-python)") from None
    llm = Llama(str(gguf), n_ctx=w.input_len + w.output_len + 8, n_threads=threads, verbose=False)
    ttfts, start = [], time.perf_counter()
    for p in prompts:
        t0 = time.perf_counter()
        llm.reset()
        for i, _ in enumerate(llm.generate(p, temp=0.0)):
            if i == 0:
                ttfts.append(time.perf_counter() - t0)
            if i + 1 == w.output_len:
                break
    total = time.perf_counter() - start
    llm.close()  # its context and threads go now, not whenever the collector runs
    return Result("llama.cpp", w.batch, w.input_len, w.output_len, total, sum(ttfts) / len(ttfts),
                  w.batch * w.output_len / total, w.batch * (w.output_len - 1) / max(total - sum(ttfts), 1e-9),
                  w.batch * w.input_len / sum(ttfts))


def median_run(runs: list[Result]) -> Result:
    """The run with the median wall time: repeats tame this kind of machine's run-to-run noise (llama-bench
    repeats 5 times for the same reason), and a whole run keeps its own numbers consistent."""
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def kv_tokens_per_gib(engine) -> dict[str, int]:
    """How many tokens of KV cache 1 GiB holds for this model, by cache dtype."""
    from dataclasses import replace

    import torch

    spec = engine.cache.spec
    return {name: replace(spec, dtype=dt).blocks_for(1 << 30) * spec.block_size
            for name, dt in (("fp16", torch.float16), ("fp8", torch.float8_e4m3fn))}
