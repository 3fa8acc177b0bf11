"""How good a draft a model would make for a target, measured before deploying it ("should I draft with my W4?").

α, the chance that the target keeps a draft token, comes from both models' next-token distributions on the same
text (teacher forcing): greedy α (the drafts quantkit's engine makes are the draft's argmax; under greedy
decoding the target keeps one when its own argmax is the same) and Σ min(p, q) (what stochastic speculative
sampling would keep at temperature 1), on held-out text, on retrieval prompts, and on the target's own greedy
continuations of held-out prompts: the text a greedy speculative run actually verifies, and so the α the
prediction uses (a model's own output is more predictable than human text: on SmolLM2 W8 with its W4 as
draft, 3.15 tokens a step were measured where held-out text's α predicted 2.61). With α per token, a step with k drafts adds (1 − α^(k+1)) / (1 − α)
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
def alpha(target, draft, rows: list[Tensor], first: list[int] | None = None, on_row=None) -> Alpha:
    """`target`/`draft` expose `logits(ids [1, seq]) -> [1, seq, vocab]`; rows: token ids [1, seq] each; first[i]:
    the first position of row i that counts (the positions predicting a continuation), default all."""
    agree, overlap, n = 0.0, 0.0, 0
    for i, row in enumerate(rows):
        start = first[i] if first else 0
        p = target.logits(row).float().softmax(-1)[0, start:]  # [positions, vocab]
        q = draft.logits(row).float().softmax(-1)[0, start:]
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        overlap += torch.minimum(p, q).sum(-1).sum().item()
        n += p.shape[0]
        if on_row:
            on_row()
    return Alpha(agree / n, overlap / n, n)


def continuations(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy continuations of the prompts (run together)."""
    from quantkit.runtime import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


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
    placed = lambda table: Batch(t([5] * rows), t(pos), t([table[p // bs] * bs + p % bs for p in pos]), [], t(list(range(rows))),
                                 Decodes.of(list(range(rows)), [table] * rows, [p + 1 for p in pos], engine.cfg.device))
    batch = placed(blocks)
    if engine.ring:  # sliding-window layers: the same rows in ring 0
        batch.windowed = placed([engine.ring.block(0, b) for b in blocks])
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
    draft and without: tokens per verifying step, acceptance rate, and the speedup in decoding time (the first
    token, the prefill's, is left out)."""
    from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
    from quantkit.runtime.speculative import SpeculativeConfig, acceptance

    cfg = target_engine.cfg
    spec = LLMEngine(target_engine.path, EngineConfig(dtype=cfg.dtype, kv_cache_memory=cfg.kv_cache_memory, speculative=SpeculativeConfig(
        "draft", k, max_batch=len(prompts), model=str(draft_path))), tokenizer=target_engine.tokenizer)
    seconds = {}
    for name, engine in (("plain", target_engine), ("draft", spec)):
        engine.warm_up()
        seconds[name] = 0.0
        for p in prompts:  # decoding time only: from the first token on (speculation changes nothing before it)
            engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            engine.step()
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            seconds[name] += time.perf_counter() - start
    a = acceptance(spec.spec_stats)
    return {"k": k, "prompts": len(prompts), "max_tokens": max_tokens, "tokens_per_step": a["mean_acceptance_length"],
            "acceptance_rate": a["acceptance_rate"], "accepted_per_pos": a["accepted_per_pos"],
            "speedup": seconds["plain"] / seconds["draft"], "seconds": seconds}
