"""KV-cache blocks: allocation, reference counts, and prefix caching by block hashes.

A full block is identified by the hash of its tokens chained with its predecessor's hash, so two
requests that share a prompt prefix (a system prompt, few-shot examples, a long RAG context) share its
blocks and compute it once. Freed blocks keep their contents and hash until they are reused, least
recently freed first, so a prefix stays cached as long as memory allows.
"""

from __future__ import annotations

from collections import OrderedDict

from quantkit.runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, rings: int = 0):
        """`rings`: how many sequences the sliding-window layers' cache holds (0: none); each sequence holding blocks
        holds one. Prefix caching is off with them: a ring keeps only a window, not the prefix a later prompt shares."""
        self.rings = rings
        self.free_rings = list(range(rings - 1, -1, -1))
        prefix_caching = prefix_caching and not rings
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.refs = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.hashed: dict[str, int] = {}  # sequence id -> how many of its blocks are hashed
        self.queries = self.hits = 0  # prefix-cache blocks looked up / found

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return len(self.refs) - len(self.free_blocks)

    def _chain(self, tokens: list[int], count: int) -> list[int]:
        out, h = [], 0
        for i in range(count):
            h = hash((h, tuple(tokens[i * self.block_size : (i + 1) * self.block_size])))
            out.append(h)
        return out

    def match_prefix(self, seq: Sequence) -> None:
        """Give a new (or preempted) sequence the cached blocks of its longest cached prefix of whole blocks;
        at least one token is left to compute, since its logits are needed."""
        if not self.prefix_caching or seq.blocks or seq.params.prompt_logprobs is not None:
            return  # a scored prompt needs the logits of every position, so nothing of it is skipped
        tokens = seq.tokens
        full = (len(tokens) - 1) // self.block_size
        for h in self._chain(tokens, full):
            self.queries += 1
            block = self.by_hash.get(h)
            if block is None:
                break
            self.hits += 1
            if self.refs[block] == 0:
                del self.free_blocks[block]
            self.refs[block] += 1
            seq.blocks.append(block)
        seq.computed = len(seq.blocks) * self.block_size
        seq.draft_computed = 0  # a draft model's keys in shared blocks may be another's or none: computed again
        self.hashed[seq.id] = len(seq.blocks)

    def ensure(self, seq: Sequence, tokens: int) -> bool:
        """Make `seq.blocks` cover `tokens` slots; False (allocating nothing) when too few blocks are free."""
        need = -(-tokens // self.block_size) - len(seq.blocks)
        if need > self.num_free or (self.rings and seq.ring is None and not self.free_rings):
            return False
        if self.rings and seq.ring is None:
            seq.ring = self.free_rings.pop()
        for _ in range(max(need, 0)):
            block, _ = self.free_blocks.popitem(last=False)  # least recently freed
            if (h := self.hash_of[block]) is not None and self.by_hash.get(h) == block:
                del self.by_hash[h]
            self.hash_of[block] = None
            self.refs[block] = 1
            seq.blocks.append(block)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full of computed tokens."""
        if not self.prefix_caching:
            return
        done = seq.computed // self.block_size
        start = self.hashed.get(seq.id, 0)
        if done <= start:
            return
        hashes = self._chain(seq.tokens, done)
        for i in range(start, done):
            block = seq.blocks[i]
            self.hash_of[block] = hashes[i]
            self.by_hash.setdefault(hashes[i], block)
        self.hashed[seq.id] = done

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks[block] = None
        seq.blocks = []
        seq.computed = seq.draft_computed = 0
        if seq.ring is not None:
            self.free_rings.append(seq.ring)
            seq.ring = None
        self.hashed.pop(seq.id, None)
