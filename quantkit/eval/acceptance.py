"""How good a draft a model would make for a target, measured before deploying it ("should I draft with my W4?").

α, the chance that the target keeps a draft token, comes from both models' next-token distributions on the same
text (teacher forcing): greedy α (the drafts quantkit's engine makes are the draft's argmax; under greedy
decoding the target keeps one when its own argmax is the same) and Σ min(p, q) (what stochastic speculative
sampling would keep at temperature 1). With α per token, a step with k drafts adds (1 − α^(k+1)) / (1 − α)
tokens. Costs come from this machine: the draft's decode step against the target's (c) and the target's step
over k + 1 rows against one (v_k); the predicted speedup is E_k / (k c + v_k). The engine then decodes prompts
of the same text with the draft, and its real tokens per verifying step and speedup stand beside the prediction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

KS = tuple(range(1, 9))


@dataclass(slots=True)
class Alpha:
    greedy: float  # P(target argmax == draft argmax)
    sampled: float  # mean over positions of sum_v min(p, q)
    tokens: int


@torch.no_grad()
def alpha(target, draft, rows: list[Tensor], on_row=None) -> Alpha:
    """`target`/`draft` expose `logits(ids [1, seq]) -> [1, seq, vocab]`; rows: token ids [1, seq] each."""
    agree, overlap, n = 0.0, 0.0, 0
    for row in rows:
        p = target.logits(row).float().softmax(-1)[0]  # [seq, vocab]
        q = draft.logits(row).float().softmax(-1)[0]
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        overlap += torch.minimum(p, q).sum(-1).sum().item()
        n += p.shape[0]
        if on_row:
            on_row()
    return Alpha(agree / n, overlap / n, n)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verifying step adds on average with k drafts each kept with probability a (geometric)."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def decode_seconds(engine, rows: int, context: int = 256, repeats: int = 7) -> float:
    """Seconds of one forward of `rows` decode rows of one sequence at `context` tokens (scratch blocks
    of the engine's idle cache): what a verifying step over rows - 1 drafts costs the model."""
    from quantkit.runtime.layers.attention import Batch, Decodes

    bs = engine.cfg.block_size
    blocks = list(range(-(-(context + rows) // bs)))
    t = lambda x: torch.tensor(x, dtype=torch.long, device=engine.cfg.device)
    pos = list(range(context, context + rows))
    batch = Batch(t([5] * rows), t(pos), t([blocks[p // bs] * bs + p % bs for p in pos]), [], t(list(range(rows))),
                  Decodes(t(list(range(rows))), t([blocks] * rows), t([p + 1 for p in pos])))
    times = []
    for _ in range(repeats + 2):  # (the first two warm the kernels' thread pools and caches up)
        start = time.perf_counter()
        engine.model(batch, engine.cache)
        times.append(time.perf_counter() - start)
    return min(times[2:])  # the least disturbed: other work on the machine only ever adds


def predict(a: float, draft_step: float, target_steps: dict[int, float]) -> list[dict]:
    """Per k: expected tokens per verifying step and speedup over plain decoding; target_steps[n] = seconds of the
    target's forward over n rows, draft_step the draft's one-row step."""
    one = target_steps[1]
    out = []
    for k in KS:
        tokens = expected_tokens(a, k)
        cost = k * draft_step / one + target_steps[k + 1] / one
        out.append({"k": k, "tokens_per_step": tokens, "speedup": tokens / cost})
    return out


def measured(target_engine, draft_path, prompts: list[list[int]], k: int, max_tokens: int = 64) -> dict:
    """The engine decoding `prompts` one at a time (greedy, a single stream, as the prediction assumes) with the
    draft and without: tokens per verifying step, acceptance rate, and the speedup in output tokens per second."""
    from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
    from quantkit.runtime.speculative import SpeculativeConfig, acceptance

    cfg = target_engine.cfg
    spec = LLMEngine(target_engine.path, EngineConfig(dtype=cfg.dtype, kv_cache_memory=cfg.kv_cache_memory, speculative=SpeculativeConfig(
        "draft", k, max_batch=len(prompts), model=str(draft_path))), tokenizer=target_engine.tokenizer)
    seconds = {}
    for name, engine in (("plain", target_engine), ("draft", spec)):
        engine.warm_up()
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        seconds[name] = time.perf_counter() - start
    a = acceptance(spec.spec_stats)
    return {"k": k, "prompts": len(prompts), "max_tokens": max_tokens, "tokens_per_step": a["mean_acceptance_length"],
            "acceptance_rate": a["acceptance_rate"], "accepted_per_pos": a["accepted_per_pos"],
            "speedup": seconds["plain"] / seconds["draft"], "seconds": seconds}
