"""Speculative decoding: draft tokens proposed cheaply, checked by the target model in one batched forward.

A decode step reads every weight once for one token per sequence; it costs about the same for a few more
positions. So a sequence that has drafted d1..dk feeds [last, d1..dk] as k+1 causal positions over its paged
KV cache and gets k+1 next-token distributions p0..pk. The positions run as k+1 decode rows (each attending
to the keys up to its own, all stored first): the kernels plain decoding uses, which are batch-invariant, so
the distributions are the ones plain decoding would compute, to the bit. The engine then draws from them in order, exactly as
it would have one step at a time (same sampler, same generator draws), and keeps the drafts while each draw
equals the draft: for a deterministic draft that accepts d with probability p(d) and, on a mismatch, has
drawn from p with d excluded, so the output's distribution (and, seeded, the output itself) is the target's.
Rejected positions' cache slots are simply written again later; the sequence's `computed` only covers kept
tokens, so the prefix cache never hashes an unverified block.

Drafts here are prompt lookup (n-grams): the longest recent n-gram that recurs earlier in the sequence
proposes the tokens that followed it. Free to compute, and strong where outputs copy their context (RAG,
tool loops, code edited in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit import QuantkitError

MAX_SPECULATIVE_TOKENS = 16  # verified positions beyond this buy nothing at realistic acceptance rates


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"  # prompt lookup; the only method so far
    num_tokens: int = 4  # k: drafts per step
    ngram_min: int = 2  # shortest suffix looked up
    ngram_max: int = 4  # longest suffix looked up (tried first)
    max_batch: int = 8  # no drafting when more sequences than this run: verification stops paying at large batch

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise QuantkitError(f"speculative method {self.method!r}: use ngram")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise QuantkitError(f"num speculative tokens must be 1..{MAX_SPECULATIVE_TOKENS}, not {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise QuantkitError(f"n-gram sizes: need 1 <= min ({self.ngram_min}) <= max ({self.ngram_max})")
        if self.max_batch < 1:
            raise QuantkitError("speculative max batch must be >= 1")


def ngram_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, for the
    longest n in [n_min, n_max] that recurs; [] when none does."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    t = torch.tensor(tokens, dtype=torch.long)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        windows = t[:-1].unfold(0, n, 1)  # [L - n, n]: every earlier n-gram (the suffix itself excluded)
        hits = (windows == t[-n:]).all(1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n  # what followed the latest occurrence
            return tokens[start : start + k]
    return []


def acceptance(stats: dict) -> dict:
    """The engine's speculation counters as rates: acceptance rate (accepted / drafted tokens), mean acceptance
    length (tokens a verifying step adds: accepted drafts plus the one drawn token), and per draft position the
    fraction of verifying steps that accepted it."""
    drafts, tokens, accepted = stats["drafts"], stats["draft_tokens"], stats["accepted"]
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "accepted_per_pos": [n / drafts if drafts else 0.0 for n in stats["accepted_per_pos"]]}
