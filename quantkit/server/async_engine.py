"""The engine behind the server: one thread steps `LLMEngine` (the process's main thread: PyTorch's CPU
matmuls run up to 5x slower when called from another thread), and every request owns an asyncio queue,
on the HTTP thread's event loop, that receives its outputs.

Adds and aborts reach the engine through a command queue, so the event loop never waits for a step, and
the engine is only ever touched by its own thread. A request whose consumer goes away (client
disconnected, task cancelled) is aborted, which frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from quantkit.runtime.engine import LLMEngine, RequestOutput
from quantkit.runtime.sampler import SamplingParams
from quantkit.server.metrics import Metrics

log = logging.getLogger("quantkit.server")


class EngineError(RuntimeError):
    """The engine failed while running a step that included this request."""


@dataclass(slots=True)
class _Request:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True)
class Snapshot:
    """The engine's state after its latest step, for /metrics, /health and backpressure."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = Metrics()
        self.snapshot = Snapshot(**engine.stats())
        self.inflight = 0  # requests added and not yet finished (event-loop side)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}  # engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        # alive from the start: the HTTP side listens a moment before `run_forever` takes its first turn, and a
        # request in that moment queues for it; False once the loop ends (shutdown, or a crash)
        self._running = True

    # --- event-loop side ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._running and not self._stop.is_set()

    def overloaded(self) -> bool:
        """Every batch slot is taken and `max_waiting` more requests wait: answer 429 instead of queueing."""
        return self.inflight >= self.engine.cfg.max_num_seqs + self.max_waiting

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, step by step, until it finishes; aborted if the consumer stops early."""
        outputs: asyncio.Queue = asyncio.Queue()
        self.inflight += 1
        self._send(("add", request_id, prompt, params, _Request(asyncio.get_running_loop(), outputs, time.monotonic())))
        finished = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self.inflight -= 1
            if not finished:
                self._send(("abort", request_id))

    def shutdown(self) -> None:
        """Make `run_forever` abort what is still running and return (after the HTTP side has drained)."""
        self._send(("stop",))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- engine thread ------------------------------------------------------------------------
    def run_forever(self) -> None:
        """Step the engine in the calling thread until `shutdown`."""
        self._running = True
        try:
            self._run()
        finally:
            self._running = False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain()
            self.snapshot = Snapshot(**self.engine.stats())
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug in a step: fail its requests, keep serving the next ones
                log.exception("engine step failed")
                for rid in list(self._requests):
                    self.engine.abort(rid)
                    self._deliver(rid, EngineError(f"engine error: {type(e).__name__}: {e}"))
                continue
            now = time.monotonic()
            for out in outputs:
                self._record(out, now)
                self._deliver(out.id, out)
            self.snapshot = Snapshot(**self.engine.stats())
        for rid in list(self._requests):  # shutting down: whatever is left ends as aborted
            self.engine.abort(rid)
            self._deliver(rid, EngineError("server shutting down"))

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt, params, req = command
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as e:  # noqa: BLE001  (the request fails, the engine goes on)
                    _post(req, e)
                    continue
                req.prompt_tokens = len(prompt)
                self._requests[rid] = req
                self.metrics.prompt_tokens += len(prompt)
            elif command[0] == "abort":
                if command[1] in self._requests:
                    self.engine.abort(command[1])
                    self._requests.pop(command[1])
                    self.metrics.finished("abort")
            else:
                self._stop.set()

    def _record(self, out: RequestOutput, now: float) -> None:
        req = self._requests.get(out.id)
        if req is None:
            return
        n = len(out.new_token_ids)
        if n and req.first is None:
            req.first = now
            self.metrics.ttft.observe(now - req.arrival)
        elif n:
            self.metrics.itl.observe((now - req.last) / n)
        if n:
            req.last, req.tokens = now, req.tokens + n
            self.metrics.generation_tokens += n
        if out.finished:
            self.metrics.e2e.observe(now - req.arrival)
            if req.tokens > 1:
                self.metrics.tpot.observe((req.last - req.first) / (req.tokens - 1))
            self.metrics.finished(out.finish_reason or "stop")

    def _deliver(self, rid: str, item: RequestOutput | Exception) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        if isinstance(item, Exception) or item.finished:
            del self._requests[rid]
        _post(req, item)


def _post(req: _Request, item: RequestOutput | Exception) -> None:
    """Hand an output to its request's event loop. A closed loop means the HTTP side is gone (a drain that ran
    out of time cancels its requests and closes the loop while the engine may still be stepping): nobody is
    left to read the output, and the engine must go on to its own shutdown, not fail on it."""
    try:
        req.loop.call_soon_threadsafe(req.outputs.put_nowait, item)
    except RuntimeError:  # "Event loop is closed"
        if not req.loop.is_closed():
            raise
