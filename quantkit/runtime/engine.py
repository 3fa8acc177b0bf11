"""The engine: requests in, one batched step at a time, tokens out. `LLM` is the library API on top.

    from quantkit import LLM, SamplingParams
    llm = LLM("out-w4")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))[0].text)
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit import QuantkitError
from quantkit.kernels import fused as fused_kernels
from quantkit.models import serving_tokenizer
from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.json_mode import JsonPrefix, choose
from quantkit.runtime.kv_cache import CacheSpec, KVCache, Ring
from quantkit.runtime.layers.attention import Batch, Decodes, SeqSlice
from quantkit.runtime.layers.linear import AMX_PANEL_MAX_ROWS, F32_PANEL_MAX_ROWS, KERNELS, panel_max_rows
from quantkit.runtime.models.llama import LlamaModel
from quantkit.runtime.sampler import Sample, SamplingParams, sample_rows, scored
from quantkit.runtime.scheduler import Scheduler, SchedulerConfig
from quantkit.runtime.sequence import Sequence, Status
from quantkit.runtime.speculative import DraftModel, SpeculativeConfig, check_draft, ngram_draft

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(slots=True)
class EngineConfig:
    dtype: str = "auto"  # compute dtype: auto (the checkpoint's 16-bit dtype, bf16 for fp32 checkpoints; on a CPU without
    # native bf16 dot products float32), bf16, fp16, fp32
    kv_cache_dtype: str = "auto"  # auto (fp8 when the checkpoint has calibrated scales, else the compute dtype), fp8, bf16, fp16, fp32
    kv_cache_memory: int | None = None  # bytes; default: enough for max_num_seqs full contexts, at most 25% of free memory
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    kernel: str = "auto"  # auto (triton on CUDA, packed on CPU) | packed | dense | reference | triton
    device: str = "auto"  # auto (cuda when available) | cpu | cuda
    lm_head: str = "auto"  # auto (the checkpoint's weights) | int8 (quantized per row at load: faster, changes logits)
    activations: str = "float"  # float | int8: int4 layers multiply int8-quantised activations (per group) in decode-sized
    # batches, as llama.cpp does: faster on CPUs without AVX-512 BF16, changes outputs (float32 activations only)
    fused: bool = True  # CPU kernels: the fused C++ decode ops (kernels/fused.py), when a compiler can build them here
    speculative: SpeculativeConfig | None = None  # draft tokens checked in the decode step (runtime/speculative.py)


@dataclass(slots=True)
class RequestOutput:
    id: str
    token_ids: list[int]  # all output tokens so far
    new_token_ids: list[int]  # produced by this step
    text: str
    delta: str  # text added by this step
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    samples: list[Sample] = field(default_factory=list)  # one per output token so far
    prompt_samples: list[Sample] = field(default_factory=list)  # prompt tokens 1.. (with prompt_logprobs)


class LLMEngine:
    def __init__(self, path: str | Path, cfg: EngineConfig | None = None, tokenizer=None):
        from quantkit import process_seconds

        self.began = process_seconds()  # the process's age when the engine began: imports, argument handling
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.device == "auto":
            cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
        if cfg.kernel == "auto":
            cfg.kernel = "triton" if cfg.device == "cuda" else "packed"
        if cfg.kernel not in KERNELS:
            raise QuantkitError(f"kernel {cfg.kernel}: use auto or one of {', '.join(KERNELS)}")
        if cfg.fused and cfg.device == "cpu" and cfg.kernel in ("packed", "dense"):
            fused_kernels.prepare()  # compile (first-ever start) or load the kernels while the weights load
        self.path = Path(path)
        hf = json.loads((self.path / "config.json").read_text())
        self.dtype = _compute_dtype(cfg.dtype, hf, cfg.device)
        if cfg.lm_head not in ("auto", "int8"):
            raise QuantkitError(f"lm_head {cfg.lm_head}: use auto or int8")
        if cfg.activations not in ("float", "int8"):
            raise QuantkitError(f"activations {cfg.activations}: use float or int8")
        if cfg.activations == "int8" and self.dtype != torch.float32:
            raise QuantkitError(f"int8 activations take float32 ones, and this engine computes in {str(self.dtype).removeprefix('torch.')} "
                                "(add --dtype fp32)")
        t0 = time.perf_counter()  # the tokenizer first: a checkpoint without one fails before its weights load
        self.tokenizer = tokenizer if tokenizer is not None else serving_tokenizer(self.path)
        tokenizer_s = time.perf_counter() - t0
        self.model = LlamaModel.load(self.path, self.dtype, cfg.kernel, cfg.device, cfg.lm_head, cfg.fused, cfg.activations)
        m = self.model.cfg
        t0 = time.perf_counter()
        self.eos = _eos_ids(self.path, self.tokenizer)
        self.context_length = m.max_position
        kv_dtype, scales, self.kv_warning = _kv_dtype(cfg.kv_cache_dtype, self.dtype, self.model.kv_scales, m.num_layers)
        spec = CacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, cfg.block_size, kv_dtype)
        self.drafter = self._draft_model() if cfg.speculative and cfg.speculative.method == "draft" else None
        # sliding-window layers keep each running sequence's last tokens in a ring of their own; the block pool (and
        # its budget) is the full-attention layers'
        windowed = [w > 0 for w in m.windows]
        self.window = max(m.windows)
        chunk = self.window or None  # prefill chunks no longer than the window
        self.ring = Ring.for_window(self.window, chunk, cfg.block_size) if any(windowed) else None
        if self.ring and self.drafter:
            raise QuantkitError("--draft with a sliding-window model is not supported yet (use --speculative ngram)")
        ring_seq = self.ring.size * sum(windowed) * spec.layer_block_bytes if self.ring else 0  # one sequence's rings
        full = CacheSpec(m.num_layers - sum(windowed), m.num_kv_heads, m.head_dim, cfg.block_size, kv_dtype)
        per_block = full.bytes_per_block + (self.drafter.spec.bytes_per_block if self.drafter else 0)
        budget = cfg.kv_cache_memory or _default_budget(full, cfg, m.max_position, ring_seq)
        # rings for as many sequences as half the budget holds (all of it when every layer is windowed): they bound how
        # many sequences run at once
        self.rings = min(cfg.max_num_seqs, budget // ring_seq if not per_block else budget // 2 // ring_seq) if ring_seq else 0
        if ring_seq and self.rings < 1:
            raise QuantkitError(f"KV-cache budget too small: one sequence's sliding-window rings need {ring_seq / 2**20:,.1f} MiB")
        # (every layer windowed, Phi-3-mini's config: blocks only number positions, and cost nothing)
        blocks = (budget - self.rings * ring_seq) // per_block if per_block else cfg.max_num_seqs * -(-m.max_position // cfg.block_size)
        if blocks < 2:
            raise QuantkitError(f"KV-cache budget too small: one block of {cfg.block_size} tokens needs {per_block} bytes")
        self.cache = KVCache(spec, blocks, self.dtype, cfg.device, scales, windowed, self.rings * (self.ring.size if self.ring else 0))
        if self.drafter:
            self.drafter.allocate(blocks, self.dtype)
        self.timings = dict(self.model.timings)  # seconds: kernels, load (checkpoint, tokenizer, KV cache), repack
        self.timings["load"] += tokenizer_s + time.perf_counter() - t0  # the tokenizer, eos ids and the KV cache
        self.blocks = BlockManager(blocks, cfg.block_size, cfg.prefix_caching, self.rings)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, chunk), self.blocks)
        self.seqs: dict[str, Sequence] = {}
        self.steps = 0
        self._ids = itertools.count()
        self._pieces: dict[int, str] = {}
        self.reset_spec_stats()
        logging.getLogger("quantkit.runtime").info(self.describe())

    def warm_up(self) -> float:
        """Run the least request that reaches prefill and decode (one prompt token, one decode step) and forget
        it, so the first real request does not pay for the kernels' first calls (thread pools, oneDNN primitives);
        -> seconds, also kept in `timings`. It is compute, not set-up: on the 1.5B an 8-token prompt cost 0.29 s
        the first time and 0.285 the second, so a longer one only delays the first answer."""
        if self.seqs:
            raise QuantkitError("warm_up runs before the first request")
        t0 = time.perf_counter()
        self.add_request([0], SamplingParams(max_tokens=2, ignore_eos=True), "quantkit-warm-up")
        while self.has_unfinished():
            self.step()
        self.steps = self.blocks.queries = self.blocks.hits = 0  # nothing of it in the served metrics
        self.reset_spec_stats()
        self.timings["warm-up"] = time.perf_counter() - t0
        return self.timings["warm-up"]

    def startup(self, then: str = "other") -> str:
        """"ready in N s (import .., kernels .., load .., repack .., warm-up .., `then` ..)": the seconds since the
        process started, split; `then` names whatever ran after the engine (a server starting to listen)."""
        from quantkit import process_seconds

        total = process_seconds()
        parts = {"import": self.began, **self.timings}
        parts[then] = max(total - sum(parts.values()), 0.0)
        return f"ready in {total:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")"

    @property
    def max_len(self) -> int:
        """Tokens one sequence may reach: the model's context, or the whole KV cache if that is smaller."""
        return min(self.context_length, self.cache.tokens)

    def describe(self) -> str:
        """What fits: the KV cache's size in tokens, blocks, dtype and bytes (reported at start)."""
        spec = self.cache.spec
        dtype = "fp8 e4m3" if self.cache.fp8 else str(spec.dtype).removeprefix("torch.")
        return (f"KV cache: {self.cache.tokens:,} tokens ({self.cache.num_blocks:,} blocks of {spec.block_size}, {dtype}, "
                f"{self.cache.bytes / 2**20:,.0f} MiB"
                + (f"; {sum(map(bool, self.model.cfg.windows))} sliding-window layers keep {self.ring.size * spec.block_size:,}"
                   f" tokens a sequence, for {self.rings} sequences at once" if self.ring else "")
                + f"); kernels: {self.cfg.kernel}"
                f"{' + ' + fused_kernels.describe() if self.model.fused else ''} on {self.cfg.device}, "
                f"{str(self.dtype).removeprefix('torch.')} activations{_dtype_reason(self.cfg, self.dtype)}"
                + (f", int8 into {self.model.int8_layers} int4 layers at up to {F32_PANEL_MAX_ROWS} rows" if self.cfg.activations == "int8" else "")
                + (f"; above {AMX_PANEL_MAX_ROWS} rows, AMX GEMMs on weights dequantised to bf16"
                   if self.model.fused and panel_max_rows(self.dtype) == AMX_PANEL_MAX_ROWS else "")
                + (f"; speculative: {spec.num_tokens} draft tokens from "
                   + (f"n-grams of {spec.ngram_min}-{spec.ngram_max}" if self.drafter is None else
                      f"{self.drafter.path.name} ({self.drafter.cache.num_blocks * self.drafter.spec.bytes_per_block / 2**20:,.0f} MiB of draft KV cache)")
                   + f", off above {spec.max_batch} sequences" if (spec := self.cfg.speculative) else ""))

    # --- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise QuantkitError("empty prompt")
        limit = self.max_len
        if len(ids) >= limit:
            raise QuantkitError(f"prompt of {len(ids)} tokens does not fit: the limit is {limit - 1} "
                                f"(context {self.context_length}, KV cache {self.cache.tokens} tokens)")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise QuantkitError(f"request id {rid} is already in use")
        seq = Sequence(rid, ids, params, arrival=self.steps)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        if params.json_object:
            seq.json_state = JsonPrefix()
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.unfinished > 0

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward, sample, and report every request that moved."""
        self.steps += 1
        work = self.scheduler.schedule()
        if not work:
            return []
        work = self._draft(work)
        batch, wants, scores = self._batch(work)
        logits = self.model(batch, self.cache)  # [S, vocab]
        outputs = []
        for seq, n in work:
            seq.computed += n - len(seq.draft)  # drafted positions count once they are verified
            self.blocks.commit(seq)
        for seq, row, first in scores:  # prompt positions first..: the log-probability of the prompt token after each
            top = seq.params.prompt_logprobs
            lps = logits[row : row + len(seq.prompt) - 1 - first].log_softmax(-1)
            seq.prompt_samples += [scored(lp, seq.prompt[first + i + 1], top) for i, lp in enumerate(lps)]
        plain = [(seq, row) for seq, row in wants if seq.params.max_tokens and seq.json_state is None and not seq.draft]
        samples = {}
        if plain:
            rows = logits if len(plain) == len(logits) else logits[[row for _, row in plain]]  # (a pure decode: every row)
            drawn = sample_rows(rows, [seq.params for seq, _ in plain], [seq.tokens for seq, _ in plain], [seq.generator for seq, _ in plain])
            samples = {seq.id: [s] for (seq, _), s in zip(plain, drawn)}
        for seq, row in wants:
            if seq.params.max_tokens == 0:
                s = []
            elif seq.draft:
                s = self._verify(seq, logits[row : row + len(seq.draft) + 1])
            elif seq.json_state is not None:
                one, seq.json_state = choose(logits[row], seq.params, seq.tokens, seq.generator, seq.json_state, self.piece,
                                             min(self.eos))
                s = [one]
            else:
                s = samples[seq.id]
            outputs.append(self._advance(seq, s))
        return outputs

    def _draft_model(self) -> DraftModel:
        """The draft model of `speculative.model`, checked against the target (tokenizer, size)."""
        from quantkit.models import resolve

        path = resolve(self.cfg.speculative.model).path
        check_draft(self.path, path, self.tokenizer, serving_tokenizer(path))  # before its weights load
        return DraftModel(path, self.dtype, self.cfg.kernel, self.cfg.device, self.cfg.fused, self.cfg.block_size)

    def reset_spec_stats(self) -> None:
        """Zero the speculation counters (vLLM's spec_decode metrics): sequence steps with drafts, draft tokens,
        accepted tokens, accepted tokens by draft position."""
        k = self.cfg.speculative.num_tokens if self.cfg.speculative else 0
        self.spec_stats = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k}

    def _draft(self, work: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Give decoding sequences their draft tokens (when speculation is on and the batch is small enough):
        -> the work with each drafted sequence's k+1 positions. Drafts never preempt: a sequence whose blocks
        cannot grow for them decodes one token as usual."""
        spec = self.cfg.speculative
        if spec is None or len(work) > spec.max_batch:
            return work
        # rows beyond what the fused decode loop takes would switch kernels (float32 panels dequantise above 32 rows)
        rows = self.model.decoder.max_rows if self.model.decoder is not None else self.cfg.max_num_batched_tokens
        budget = min(self.cfg.max_num_batched_tokens, rows) - sum(n for _, n in work)
        wanted = []  # (sequence, drafts it may take)
        for seq, n in work:
            p = seq.params
            room = min(spec.num_tokens, p.max_tokens - len(seq.output) - 1, self.max_len - len(seq) - 1, budget)
            if n == 1 and seq.computed == len(seq) - 1 and seq.json_state is None and room > 0:
                if self.drafter is None:
                    seq.draft = ngram_draft(seq.tokens, room, spec.ngram_min, spec.ngram_max)
                    room = len(seq.draft)
                if room and self.blocks.ensure(seq, len(seq) + room):
                    wanted.append((seq, room))
                    budget -= room
                else:
                    seq.draft = []
        if self.drafter is not None and wanted:
            for (seq, _), draft in zip(wanted, self.drafter.propose(wanted)):
                seq.draft = draft
        for seq, _ in wanted:
            self.spec_stats["drafts"] += 1
            self.spec_stats["draft_tokens"] += len(seq.draft)
        return [(seq, n + len(seq.draft)) for seq, n in work]

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[Sample]:
        """Draw from the target's distributions [k+1, vocab] one position at a time, as plain decoding would,
        keeping drafts while each draw equals its draft: -> the tokens this step adds (accepted drafts, then
        the first draw that differs, or the bonus token after them all)."""
        draft, seq.draft = seq.draft, []
        rows, seen = len(draft) + 1, [seq.tokens + draft[:i] for i in range(len(draft) + 1)]
        # greedy draws need no generator: all rows at once; a random draw waits for the one before it (same order)
        drawn = sample_rows(logits, [seq.params] * rows, seen, [None] * rows) if seq.params.greedy else None
        out: list[Sample] = []
        for i in range(rows):
            s = drawn[i] if drawn else sample_rows(logits[i : i + 1], [seq.params], [seen[i]], [seq.generator])[0]
            out.append(s)
            if i == len(draft) or s.token != draft[i]:
                break
            self.spec_stats["accepted"] += 1
            self.spec_stats["accepted_per_pos"][i] += 1
        seq.computed += len(out) - 1  # the accepted drafts' keys and values are already in the cache
        seq.draft_computed = min(seq.draft_computed, len(seq) + len(out) - 1)  # the draft's, up to its last accepted token
        return out

    def _batch(self, work: list[tuple[Sequence, int]]) -> tuple[Batch, list[tuple[Sequence, int]], list[tuple[Sequence, int, int]]]:
        """-> the batch, (sequence, logits row) to sample from, (sequence, first logits row, first prompt
        position) of prompts being scored."""
        tokens, positions, slots, seqs, wanted, wants, scores = [], [], [], [], [], [], []
        decode_rows, decode_tables, decode_lens = [], [], []
        ring_slots, ring_seqs, ring_tables, ring_lens = [], [], [], []  # the same, placed in the sliding-window layers' rings
        bs = self.cfg.block_size
        for seq, n in work:
            offset, start = len(tokens), seq.computed
            pos = list(range(start, start + n))
            known = seq.tokens + seq.draft
            tokens += known[start : start + n]
            positions += pos
            slots += [seq.blocks[p // bs] * bs + p % bs for p in pos]
            blocks = seq.blocks[: -(-(start + n) // bs)]
            # windowed layers attend from the first block any of these queries sees, positions counted from there:
            # their ring blocks from that one on (the blocks behind it are neither read nor written this step)
            skip = max(0, start - self.window + 1) // bs if self.ring else 0
            ring = [self.ring.block(seq.ring, b) for b in range(skip, len(blocks))] if self.ring else []
            ring_slots += [ring[p // bs - skip] * bs + p % bs for p in pos] if self.ring else []
            if n == 1 or seq.draft:  # a verification's positions attend as decodes do: the same kernels, the same roundings
                decode_rows += range(offset, offset + n)
                decode_tables += [blocks] * n
                ring_tables += [ring] * n
                decode_lens += range(start + 1, start + n + 1)
                ring_lens += range(start + 1 - skip * bs, start + n + 1 - skip * bs)
            else:
                seqs.append(SeqSlice(offset, n, start, torch.tensor(blocks, dtype=torch.long)))
                ring_seqs.append(SeqSlice(offset, n, start - skip * bs, torch.tensor(ring, dtype=torch.long)))
            if seq.params.prompt_logprobs is not None:
                first = len(seq.prompt_samples)  # after a preemption, positions already scored are not scored again
                upto = min(start + n, len(seq.prompt) - 1)
                if first < upto:
                    scores.append((seq, len(wanted), first))
                    wanted += range(offset + first - start, offset + upto - start)
            if start + n == len(known):  # its last known token is in: sample the next one (and check drafts)
                wants.append((seq, len(wanted)))
                wanted += range(offset + n - 1 - len(seq.draft), offset + n)
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.cfg.device)
        decodes = Decodes.of(decode_rows, decode_tables, decode_lens, self.cfg.device)
        batch = Batch(t(tokens), t(positions), t(slots), seqs, t(wanted), decodes)
        if self.ring:
            batch.windowed = Batch(batch.tokens, batch.positions, t(ring_slots), ring_seqs, batch.logits_index,
                                   Decodes.of(decode_rows, ring_tables, ring_lens, self.cfg.device))
        return batch, wants, scores

    def single(self, tokens: torch.Tensor, all_logits: bool = False) -> Batch:
        """One sequence's tokens [n] in blocks 0, 1, ... outside the scheduler (a scoring pass: perplexity, KL)."""
        return Batch.single(tokens, self.cfg.block_size, all_logits, self.ring)

    def _advance(self, seq: Sequence, samples: list[Sample]) -> RequestOutput:
        """Append this step's tokens (none: `max_tokens=0`, the prompt only was wanted; several: accepted drafts)
        one by one, and decide whether it finished: a stop ends it at that token, the rest is dropped."""
        p = seq.params
        reason = None if samples else "length"
        before, added = seq.text, []
        for s in samples:
            seq.output.append(s.token)
            seq.samples.append(s)
            added.append(s.token)
            if not p.ignore_eos and s.token in self.eos or s.token in p.stop_token_ids:
                reason = "stop"
            if p.stop or reason or s is samples[-1]:
                seq.text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
            for stop in p.stop:
                if (at := seq.text.find(stop, max(len(before) - len(stop), 0))) >= 0:
                    seq.text, reason = seq.text[:at], "stop"
                    break
            if reason is None and (len(seq.output) >= p.max_tokens or len(seq) >= self.max_len):
                reason = "length"
            if reason:
                break
        if reason:
            self.scheduler.finish(seq, reason)
            self.seqs.pop(seq.id, None)
        shown = seq.text if reason else _settled(seq.text, p.stop)
        delta, seq.emitted = shown[seq.emitted :], max(seq.emitted, len(shown))
        return RequestOutput(seq.id, list(seq.output), added, seq.text, delta, reason is not None,
                             reason, len(seq.prompt), list(seq.samples), list(seq.prompt_samples))

    def piece(self, token: int) -> str:
        """A token's text decoded alone (cached): what the JSON constraint checks."""
        if (text := self._pieces.get(token)) is None:
            text = self._pieces[token] = self.tokenizer.decode([token])
        return text

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.blocks.num_used, "kv_blocks_total": len(self.blocks.refs),
                "prefix_cache_queries": self.blocks.queries, "prefix_cache_hits": self.blocks.hits,
                "preemptions": self.scheduler.preemptions, "spec_drafts": self.spec_stats["drafts"],
                "spec_draft_tokens": self.spec_stats["draft_tokens"], "spec_accepted_tokens": self.spec_stats["accepted"],
                "spec_accepted_per_pos": tuple(self.spec_stats["accepted_per_pos"])}


class LLM:
    """Offline generation: `generate` runs a list of prompts to completion with continuous batching;
    `stream` yields one request's outputs token by token."""

    def __init__(self, model: str | Path, **engine_args):
        from quantkit.models import resolve

        self.engine = LLMEngine(resolve(str(model)).path, EngineConfig(**engine_args))

    def generate(self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(self._ids(p), sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.id] = out
        return [done[i] for i in ids]

    def _ids(self, prompt: str | list[int]) -> list[int]:
        """A text prompt as the server's /v1/completions tokenizes it (and vLLM's LLM.generate): with the tokenizer's
        special tokens, i.e. its BOS where it adds one (Gemma without <bos> degenerates)."""
        return self.engine.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        rid = self.engine.add_request(self._ids(prompt), params)
        while True:
            for out in self.engine.step():
                if out.id == rid:
                    yield out
                    if out.finished:
                        return


def _settled(text: str, stops: list[str]) -> str:
    """The part of an unfinished output that can be shown: without a trailing partial UTF-8 character, and
    without a tail that may be the start of a stop string (which would have to be taken back)."""
    text = text.rstrip("\ufffd")
    hold = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return text[: len(text) - hold]


def _compute_dtype(name: str, hf: dict, device: str) -> torch.dtype:
    """auto: 16-bit activations where they are native (a GPU, a CPU with AVX512_BF16 or AMX); elsewhere float32,
    since PyTorch emulates bf16 GEMMs there at a fraction of float32's speed and quantkit's int4/int8 kernels take
    float32 activations on every CPU."""
    if name != "auto":
        if name not in DTYPES:
            raise QuantkitError(f"dtype {name}: use auto, bf16, fp16 or fp32")
        return DTYPES[name]
    if device == "cpu" and not fused_kernels.native_bf16():
        return torch.float32
    src = str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16")
    return torch.float16 if src == "float16" else torch.bfloat16


def _dtype_reason(cfg: EngineConfig, dtype: torch.dtype) -> str:
    if cfg.dtype != "auto" or cfg.device != "cpu":
        return ""
    return " (native bf16 dot products)" if dtype != torch.float32 else " (this CPU has no native bf16 dot products)"


def _kv_dtype(name: str, compute: torch.dtype, scales, layers: int):
    """-> (storage dtype, per-layer scales or None, warning or None)."""
    if name == "auto":
        name = "fp8" if scales is not None else "compute"
    if name == "fp8":
        if scales is None:
            warning = ("FP8 KV cache without calibrated k_scale/v_scale in the checkpoint: using scale 1.0, which "
                       "clips keys and values beyond +-448 and loses precision near zero (quantize with --kv-cache fp8)")
            print(f"warning: {warning}", file=sys.stderr)
            one = torch.ones(1)
            return torch.float8_e4m3fn, [(one, one)] * layers, warning
        return torch.float8_e4m3fn, scales, None
    if name == "compute":
        return compute, None, None
    if name not in DTYPES:
        raise QuantkitError(f"kv cache dtype {name}: use auto, fp8, bf16, fp16 or fp32")
    return DTYPES[name], None, None


def _default_budget(spec: CacheSpec, cfg: EngineConfig, context: int, per_sequence: int = 0) -> int:
    """Enough for max_num_seqs full contexts (plus `per_sequence` bytes each: sliding-window rings), at most a
    quarter of the free memory."""
    want = cfg.max_num_seqs * (context * spec.bytes_per_block // spec.block_size + per_sequence)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 4 << 30
    return min(want, avail // 4)


def _eos_ids(path: Path, tokenizer) -> set[int]:
    ids = set()
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
