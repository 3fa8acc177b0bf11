"""Continuous batching: every step, running sequences first (one decode token each, or the next chunk
of an unfinished prefill), then waiting ones, under a token budget; when blocks run out, the newest
running sequence is preempted and later recomputed, never a crash."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sequence import Sequence, Status


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens per step: prefill chunks plus decodes
    max_chunk: int | None = None  # tokens of one sequence per step (sliding-window rings hold window + chunk)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """-> (sequence, tokens to compute this step) pairs."""
        budget = self.cfg.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            n = min(len(seq) - seq.computed, budget, self.cfg.max_chunk or budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.blocks.ensure(seq, seq.computed + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.append((seq, n))
                kept.append(seq)
                budget -= n
        self.running = kept
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            n = min(len(seq) - seq.computed, budget, self.cfg.max_chunk or budget)
            if not self.blocks.ensure(seq, seq.computed + n):
                self.blocks.free(seq)  # a waiting sequence holds no blocks (its cached prefix stays matchable)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
