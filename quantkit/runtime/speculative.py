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

Drafts come from prompt lookup (n-grams: the longest recent n-gram that recurs earlier in the sequence
proposes the tokens that followed it; free, and strong where outputs copy their context: RAG, tool loops,
code edited in place) or from a draft model (`DraftModel`: a smaller sibling or the target's own INT4
checkpoint, same tokenizer) decoding greedily. Both are deterministic given the context, which is what makes
"draw from the target, keep the draft while they agree" exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit import QuantkitError
from quantkit.runtime.kv_cache import CacheSpec, KVCache
from quantkit.runtime.layers.attention import Batch, Decodes, SeqSlice
from quantkit.runtime.sampler import argmax_rows
from quantkit.runtime.sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16  # verified positions beyond this buy nothing at realistic acceptance rates
CATCH_UP_ROWS = MAX_SPECULATIVE_TOKENS + 1  # up to this many new tokens a draft forward feeds as decode rows


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"  # ngram (prompt lookup) | draft (a draft model: `model`)
    num_tokens: int = 4  # k: drafts per step
    ngram_min: int = 2  # shortest suffix looked up
    ngram_max: int = 4  # longest suffix looked up (tried first)
    max_batch: int = 4  # no drafting when more sequences run: at 8 SmolLM2 W4 with n-grams was 0.91-1.06x plain (docs/benchmarks.md)
    model: str | None = None  # method draft: the draft model's directory (resolved)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise QuantkitError(f"speculative method {self.method!r}: use ngram, or a draft model")
        if (self.method == "draft") != (self.model is not None):
            raise QuantkitError("a draft model goes with speculative method draft, and only with it")
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


class DraftModel:
    """A draft model decoding greedily into its own paged KV cache, laid out in the target's blocks (same block
    ids and size, its own tensors): the block manager's tables serve both, and preemption or a finish frees both.
    `Sequence.draft_computed` counts the positions whose draft keys are valid; each step first feeds the draft what
    it has not seen (the whole context the first time, after that the tokens the last step added)."""

    def __init__(self, path: Path, dtype: torch.dtype, kernel: str, device: str, fused: bool, block_size: int):
        from quantkit.runtime.models.llama import LlamaModel

        self.path, self.device = path, device
        self.model = LlamaModel.load(path, dtype, kernel, device, "auto", fused)
        m = self.model.cfg
        self.spec = CacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, block_size, dtype)
        self.cache: KVCache | None = None

    def allocate(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.cache = KVCache(self.spec, num_blocks, dtype, self.device, None)

    def propose(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """(sequence, drafts wanted) -> each one's greedy drafts; their blocks already cover len(seq) + wanted."""
        drafts = [[] for _ in items]
        feeds = [(seq, seq.tokens[seq.draft_computed :], seq.draft_computed) for seq, _ in items]
        for step in range(max(k for _, k in items)):
            live = [i for i, (_, k) in enumerate(items) if k > step]
            tokens = self._next([feeds[i] for i in live])
            for i, t in zip(live, tokens):
                seq = items[i][0]
                drafts[i].append(t)
                seq.draft_computed = feeds[i][2] + len(feeds[i][1])
                feeds[i] = (seq, [t], seq.draft_computed)
        return drafts

    def _next(self, feeds: list[tuple[Sequence, list[int], int]]) -> list[int]:
        """One batched draft forward: each (sequence, new tokens, their first position) -> its next greedy token."""
        bs = self.spec.block_size
        tokens, positions, slots, slices, wanted = [], [], [], [], []
        rows, tables, lengths = [], [], []
        for seq, new, start in feeds:
            offset, n = len(tokens), len(new)
            pos = range(start, start + n)
            tokens += new
            positions += pos
            slots += [seq.blocks[p // bs] * bs + p % bs for p in pos]
            blocks = seq.blocks[: -(-(start + n) // bs)]
            if n <= CATCH_UP_ROWS:  # a few tokens (last step's accepted ones) attend as decode rows: the fused decode loop
                rows += range(offset, offset + n)
                tables += [blocks] * n
                lengths += range(start + 1, start + n + 1)
            else:  # a whole context (first draft, after a preemption or a prefix-cache hit): a prefill chunk
                slices.append(SeqSlice(offset, n, start, torch.tensor(blocks, dtype=torch.long)))
            wanted.append(offset + n - 1)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)
        decodes = Decodes.of(rows, tables, lengths, self.device)
        logits = self.model(Batch(t(tokens), t(positions), t(slots), slices, t(wanted), decodes), self.cache)
        return argmax_rows(logits).tolist()


def check_draft(target_path: Path, draft_path: Path, target_tok, draft_tok) -> None:
    """Refuse a draft that cannot serve: another tokenizer (the first token whose id differs is named), or more
    weight bytes than the target (it would cost more than it saves)."""
    from quantkit.models import weight_files

    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a != b:
        diff = next((t for t in sorted(a.keys() | b.keys(), key=lambda t: a.get(t, b.get(t))) if a.get(t) != b.get(t)), None)
        raise QuantkitError(f"draft {draft_path.name} has another tokenizer than the target: token {diff!r} is "
                            f"{a.get(diff)} in the target, {b.get(diff)} in the draft ({len(a):,} vs {len(b):,} tokens)")
    mine, theirs = (sum(f.stat().st_size for f in weight_files(p)) for p in (draft_path, target_path))
    if mine > theirs:
        raise QuantkitError(f"draft {draft_path.name} ({mine / 2**20:,.0f} MiB of weights) is larger than "
                            f"the target ({theirs / 2**20:,.0f} MiB): it would cost more than it saves")
