"""The asyncio face of the engine: the engine loop runs on its own thread.

Servers call ``generate``/``prefill``/``decode`` from their event loop. A request is
validated there (bad input raises ValueError at once), handed to the engine thread
through a queue, and its outputs come back through an ``asyncio.Queue`` fed with
``call_soon_threadsafe``: the event loop never waits on the model. Leaving a stream early
(the client went away, the task was cancelled) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
import logging
import queue
import threading
import time
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.execution.lora import LoraAdapter
from engine.outputs import KVWanted, PrefillResult, RequestOutput
from engine.request import PRIORITY_MAX, PRIORITY_MIN, GenerationRequest, Mode

logger = logging.getLogger(__name__)
RECEIVING_POLL_S = 1.0  # how often an idle engine checks the deadlines of requests waiting for their KV


class EngineError(RuntimeError):
    """The engine failed while running this request (not the request's fault)."""


@dataclass
class EngineStats:
    blocks_total: int
    blocks_used: int  # held by a running or waiting sequence
    blocks_cached: int  # held by none, content kept for prefix hits until evicted
    waiting_by_priority: dict[int, int]
    running: int  # sequences (a request with n choices counts n once forked)
    finished_by_reason: dict[str, int]  # choices ended since start; "abort" counts cancellations and clients gone
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int  # of those, tokens found
    prompt_tokens_computed: int  # prompt tokens run through the model since start (hits and imports are not)
    queued_prompt_tokens: int  # prompt tokens waiting to run through the model (Scheduler.queued_prompt_tokens)
    spec_decode_num_drafts: int  # steps of a sequence that verified draft tokens (engine/decoding/speculative.py)
    spec_decode_num_draft_tokens: int  # draft tokens verified
    spec_decode_num_accepted_tokens: int  # of those, the ones that stood
    dtype: str
    requests: int  # requests with a sequence here: running, waiting, or receiving their KV
    prefix_holds: int  # prefixes held for requests that have not come yet (engine/prefix_holds.py)

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks_used / self.blocks_total


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._finished: collections.Counter[str] = collections.Counter()
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- the server's side -------------------------------------------------------------

    async def generate(self, request: GenerationRequest, lora: LoraAdapter | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``. ``lora``: the weights
        of the adapter the request names, in each of these calls."""
        async for output in self._submit(request, Mode.GENERATE, None, lora):
            yield output

    async def prefill(self, request: GenerationRequest, kv_export_start: int = 0, lora: LoraAdapter | None = None
                      ) -> list[RequestOutput]:
        """Run the prompt; one output per choice, by index: ``finished``, or carrying ``prefill``
        (the same result for every choice that goes on to decode)."""
        outputs = [output async for output in self._submit(request, Mode.PREFILL, None, lora, kv_export_start)]
        return sorted(outputs, key=lambda output: output.index)

    async def decode(self, request: GenerationRequest, prefill: PrefillResult, lora: LoraAdapter | None = None
                     ) -> AsyncIterator[RequestOutput | KVWanted]:
        """Import P's KV and stream the tokens after the first. When ``prefill.kv.data`` is None,
        the first item is a ``KVWanted``, once the request holds blocks for the KV: fetch the
        bytes then and hand them over with ``receive_kv``."""
        async for output in self._submit(request, Mode.DECODE, prefill, lora):
            yield output

    async def hold_prefix(self, request: GenerationRequest, lora: LoraAdapter | None, hold_s: float) -> int:
        """The leading tokens of ``request``'s prompt that this engine's prefix cache holds, kept
        for the request until it ends or for ``hold_s`` if it does not come (LLMEngine.hold_prefix).
        Answered by the engine thread between two steps."""
        self.engine.validate(request, lora=lora)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._commands.put(("hold", request, lora, time.time() + hold_s, loop, answer))
        self._wake.set()
        return await answer

    def receive_kv(self, request_id: str, data) -> None:
        self._commands.put(("kv", request_id, data))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """Queue and KV-block counts as of the last engine step (for metrics and health)."""
        return self._stats

    def _snapshot(self) -> EngineStats:
        scheduler, blocks, drafter = self.engine.scheduler, self.engine.blocks, self.engine.drafter
        waiting = {p: 0 for p in range(PRIORITY_MIN, PRIORITY_MAX + 1)}
        for seq in scheduler.waiting:
            waiting[seq.priority] += 1
        counts = blocks.counts()
        return EngineStats(counts.total, counts.held, counts.cached, waiting, len(scheduler.running),
                           dict(self._finished), blocks.prefix_queries, blocks.prefix_hits,
                           scheduler.num_prompt_tokens_computed, scheduler.queued_prompt_tokens(),
                           drafter.num_drafts, drafter.num_draft_tokens, drafter.num_accepted_tokens,
                           self.engine.dtype, len(self.engine.active_request_ids()), len(self.engine.holds))

    def num_streams(self) -> int:
        """Callers' streams open now (read live: a stream closes on the caller's loop, after the last step)."""
        with self._lock:
            return len(self._streams)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def _submit(self, request: GenerationRequest, mode: Mode, prefill: PrefillResult | None,
                      lora: LoraAdapter | None, kv_export_start: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's outputs until every choice has ended (or, PREFILL, gone on to D)."""
        self.engine.validate(request, mode, prefill, lora)
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request_id: {request.request_id!r} is already running")
            self._streams[request.request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", request, mode, prefill, kv_export_start, lora))
        self._wake.set()
        remaining = {c.index for c in prefill.choices} if prefill is not None else set(range(request.n))
        if request.params.beam_width > 1:
            remaining = {0}  # beams end in one output
        done = False
        try:
            while not done:
                output = await outputs.get()
                if isinstance(output, Exception):
                    done = True
                    raise output
                if isinstance(output, KVWanted):
                    yield output
                    continue
                if output.finished or output.prefill is not None:
                    remaining.discard(output.index)
                done = not remaining
                yield output
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not done:
                self.abort(request.request_id)

    # ---- the engine thread -------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped:
            if not self.engine.has_work() and self._commands.empty():
                # Requests waiting for their KV still expire at their deadline, prefix holds at theirs.
                polls = self.engine.scheduler.receiving or len(self.engine.holds)
                self._wake.wait(RECEIVING_POLL_S if polls else None)
            self._wake.clear()
            self._drain_commands()
            try:
                outputs = self.engine.step()
            except Exception as error:  # keep serving: fail the running requests, not the server
                logger.exception("engine step failed")
                self._fail_all(error)
                continue
            # Stats first: a caller that has its request's last output sees the engine without it.
            self._finished.update(output.finish_reason for output in outputs if output.finished)
            self._stats = self._snapshot()
            for output in outputs:
                self._deliver(output.request_id, output)
            for request_id in self.engine.take_kv_wanted():
                self._deliver(request_id, KVWanted(request_id))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request, mode, prefill, kv_export_start, lora = command
                try:
                    self.engine.add_request(request, mode, prefill, kv_export_start, lora)
                except Exception as error:
                    self._deliver(request.request_id, error)
            elif command[0] == "hold":
                _, request, lora, until, loop, answer = command
                try:
                    result = self.engine.hold_prefix(request, lora, until)
                except Exception as error:
                    result = error
                loop.call_soon_threadsafe(_settle, answer, result)
            elif command[0] == "kv":
                self.engine.receive_kv(command[1], command[2])
            else:
                for output in self.engine.abort(command[1]):
                    self._finished[output.finish_reason] += 1
                    self._deliver(output.request_id, output)

    def _fail_all(self, error: Exception) -> None:
        for request_id in self.engine.active_request_ids():
            self.engine.abort(request_id)
            self._deliver(request_id, EngineError(f"engine step failed: {error}"))

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)


def _settle(future: asyncio.Future, result) -> None:
    """Set a future from the engine thread's answer (an exception is raised to its awaiter)."""
    if future.done():  # its awaiter was cancelled
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
