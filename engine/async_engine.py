"""The asyncio face of the engine: the engine loop runs on its own thread.

Servers call ``generate``/``prefill``/``decode`` from their event loop. A request is
validated there (bad input raises ValueError at once), handed to the engine thread
through a queue, and its outputs come back through its ``_Outbox``: the event loop never
waits on the model. Leaving a stream early (the client went away, the task was cancelled)
aborts the request and frees its blocks.

Outputs coalesce at the source: the engine thread appends each step's output to the stream's
outbox, and wakes a caller's loop once per step (one ``call_soon_threadsafe`` for all its
streams), only for the streams whose outbox was empty. A caller that is behind takes every
output made since it last took, in order, as one batch (``generate_batches``): a server sends
one item per wake-up, not one per token, and each output stays as the engine made it (its
tokens, text, logprobs), so what reaches a client is token for token what it was.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import asdict, dataclass, field
import logging
import queue
import threading
import time
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora_adapter import LoraAdapter
from engine.outputs import KVWanted, PrefillResult, RequestOutput
from engine.request import PRIORITY_MAX, PRIORITY_MIN, GenerationRequest, Mode
from engine.running_export import Moved

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
    waiting_background: int = 0  # of the waiting, background ones (Batch API lines: engine/scheduler.py)
    kv_tier: dict[str, int] = field(default_factory=dict)  # the second tier's counts (engine/kv_tier.py); {} without one

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks_used / self.blocks_total


@dataclass
class AddRequest:
    """Engine-thread command: queue ``request`` (LLMEngine.add_request); a refusal goes to its stream."""

    request: GenerationRequest
    mode: Mode
    prefill: PrefillResult | None
    kv_export_start: int
    lora: LoraAdapter | None


@dataclass
class HoldPrefix:
    """Engine-thread command: hold ``request``'s cached prefix until ``until``; the count (or the
    error) settles ``answer`` on ``loop``."""

    request: GenerationRequest
    lora: LoraAdapter | None
    until: float
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future


@dataclass
class ReceiveKV:
    """Engine-thread command: a receiving request's KV bytes have arrived."""

    request_id: str
    data: object  # [L, 2, T, Hkv, D] array


@dataclass
class ImportPrefix:
    """Engine-thread command: write blocks from the prefix store for a request added after it
    (LLMEngine.import_prefix)."""

    request_id: str
    keys: list[bytes]
    first: int
    data: object  # [L, 2, (len(keys) - first) * block_size, Hkv, D] array
    until: float


@dataclass
class Abort:
    """Engine-thread command: end every choice of ``request_id``."""

    request_id: str


@dataclass
class MoveOut:
    """Engine-thread command: hand every running request that can move to another engine
    (LLMEngine.move_out); each one's stream ends with its ``Moved``."""


EngineCommand = AddRequest | HoldPrefix | ReceiveKV | ImportPrefix | Abort | MoveOut


@dataclass
class _Outbox:
    """One caller's stream: what the engine thread has delivered and the caller not yet taken.
    ``pending`` is guarded by the engine's lock; ``ready`` lives on the caller's loop and is set
    there (``_wake_loop``) when ``pending`` goes from empty to not."""

    loop: asyncio.AbstractEventLoop
    pending: list = field(default_factory=list)  # RequestOutput | KVWanted | Exception, in delivery order
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Build the engine on its own thread (``_run``) and start its loop there; raises what
        building raised."""
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Outbox] = {}
        self._to_wake: list[_Outbox] = []  # engine thread: outboxes that became non-empty since the last flush
        self._lock = threading.Lock()
        self._stopped = False
        self._finished: collections.Counter[str] = collections.Counter()
        self._step_started: float | None = None  # time.monotonic() when the step running now began
        self._hang_s = 0.0  # fault hook: the next step first waits this long (hang_next_step)...
        self._hang_over = threading.Event()  # ... or until this is set (end_hang)
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(config, built, failure), name="pdserve-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    # ---- the server's side -------------------------------------------------------------

    async def generate(self, request: GenerationRequest, lora: LoraAdapter | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``. ``lora``: the weights
        of the adapter the request names, in each of these calls."""
        async for batch in self.generate_batches(request, lora):
            for output in batch:
                yield output

    async def generate_batches(self, request: GenerationRequest, lora: LoraAdapter | None = None
                               ) -> AsyncIterator[list[RequestOutput]]:
        """``generate``'s outputs, as batches: each holds every output made since the caller took
        the last (one per step per choice, in order), so a caller that is behind catches up in one
        wake-up. Never empty."""
        async for batch in self._submit(request, Mode.GENERATE, None, lora):
            yield batch

    async def prefill(self, request: GenerationRequest, kv_export_start: int = 0, lora: LoraAdapter | None = None
                      ) -> list[RequestOutput]:
        """Run the prompt; one output per choice, by index: ``finished``, or carrying ``prefill``
        (the same result for every choice that goes on to decode)."""
        outputs = [output async for batch in self._submit(request, Mode.PREFILL, None, lora, kv_export_start)
                   for output in batch]
        return sorted(outputs, key=lambda output: output.index)

    async def decode_batches(self, request: GenerationRequest, prefill: PrefillResult,
                             lora: LoraAdapter | None = None) -> AsyncIterator[list[RequestOutput | KVWanted]]:
        """Import P's KV and stream the tokens after the first, in batches (``generate_batches``).
        When ``prefill.kv.data`` is None, a ``KVWanted`` comes first, once the request holds blocks
        for the KV: fetch the bytes then and hand them over with ``receive_kv``; it may share a batch.
        A request handed elsewhere (``move_out``) ends with its ``Moved``, here as in ``generate_batches``."""
        async for batch in self._submit(request, Mode.DECODE, prefill, lora):
            yield batch

    async def hold_prefix(self, request: GenerationRequest, lora: LoraAdapter | None, hold_s: float) -> int:
        """The leading tokens of ``request``'s prompt that this engine's prefix cache holds, kept
        for the request until it ends or for ``hold_s`` if it does not come (LLMEngine.hold_prefix).
        Answered by the engine thread between two steps."""
        self.engine.validate(request, lora=lora)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._commands.put(HoldPrefix(request, lora, time.time() + hold_s, loop, answer))
        self._wake.set()
        return await answer

    def receive_kv(self, request_id: str, data) -> None:
        self._commands.put(ReceiveKV(request_id, data))
        self._wake.set()

    def import_prefix(self, request_id: str, keys: list[bytes], first: int, data, hold_s: float) -> None:
        """Write the KV of ``keys[first:]``, pulled from the app's prefix store, into the pool for
        ``request_id`` (LLMEngine.import_prefix), on the engine thread before the commands sent after
        it (the request's own): held for it, or for ``hold_s`` if it does not come."""
        self._commands.put(ImportPrefix(request_id, keys, first, data, time.time() + hold_s))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))
        self._wake.set()

    def move_out(self) -> None:
        """Hand every running request that can move now to another engine, between two steps: each
        stream's last item is then its ``Moved`` (engine/running_export.py). The rest stay; ask again."""
        self._commands.put(MoveOut())
        self._wake.set()

    def stats(self) -> EngineStats:
        """Queue and KV-block counts as of the last engine step (for metrics and health)."""
        return self._stats

    def _snapshot(self) -> EngineStats:
        scheduler, blocks, drafter = self.engine.scheduler, self.engine.blocks, self.engine.drafter
        waiting = {p: 0 for p in range(PRIORITY_MIN, PRIORITY_MAX + 1)}
        background = 0
        for seq in scheduler.waiting:
            waiting[seq.priority] += 1
            background += seq.background
        counts = blocks.counts()
        return EngineStats(counts.total, counts.held, counts.cached, waiting, len(scheduler.running),
                           dict(self._finished), blocks.prefix_queries, blocks.prefix_hits,
                           scheduler.num_prompt_tokens_computed, scheduler.queued_prompt_tokens(),
                           drafter.num_drafts, drafter.num_draft_tokens, drafter.num_accepted_tokens,
                           self.engine.dtype, len(self.engine.active_request_ids()), len(self.engine.holds),
                           background, {} if blocks.tier is None else asdict(blocks.tier.counts))

    def num_streams(self) -> int:
        """Callers' streams open now (read live: a stream closes on the caller's loop, after the last step)."""
        with self._lock:
            return len(self._streams)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def step_running_s(self) -> float:
        """How long the step running now has run, 0 between steps: the step watchdog's reading
        (deployments/replicas/servers.py), which a live thread stuck inside one step cannot fake."""
        started = self._step_started
        return time.monotonic() - started if started is not None else 0.0

    def hang_next_step(self, seconds: float) -> None:
        """Fault injection: the next step waits ``seconds`` (or until ``end_hang``) before it runs,
        as a step stuck in a kernel or a collective would. Servers let only tests call it
        (deployments/replicas/servers.py)."""
        self._hang_over.clear()
        self._hang_s = seconds
        self._wake.set()

    def end_hang(self) -> None:
        """Fault injection: a step hung by ``hang_next_step`` goes on now."""
        self._hang_over.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def open_batches(self, request: GenerationRequest, lora: LoraAdapter | None = None
                     ) -> AsyncIterator[list[RequestOutput]]:
        """``generate_batches``, with the request checked and queued now (ValueError at once, not at
        the first read): a caller that hands the iterator to a task answers before the first output
        (deployments/replicas/output_channels.py). One that may drop it unread calls ``close_stream``."""
        outbox = self._open(request, Mode.GENERATE, None, lora)
        return self._batches(request, outbox, None)

    def close_stream(self, request_id: str) -> None:
        """End ``request_id``'s stream if it is open: the request is aborted and its blocks freed.
        Idempotent; a stream that ended already is left as it is."""
        with self._lock:
            open_stream = self._streams.pop(request_id, None)
        if open_stream is not None:
            self.abort(request_id)

    async def _submit(self, request: GenerationRequest, mode: Mode, prefill: PrefillResult | None,
                      lora: LoraAdapter | None, kv_export_start: int = 0) -> AsyncIterator[list]:
        """The request's outputs, in batches, until every choice has ended (or, PREFILL, gone on
        to D). An engine failure is raised after the outputs delivered before it."""
        outbox = self._open(request, mode, prefill, lora, kv_export_start)
        async for batch in self._batches(request, outbox, prefill):
            yield batch

    def _open(self, request: GenerationRequest, mode: Mode, prefill: PrefillResult | None,
              lora: LoraAdapter | None, kv_export_start: int = 0) -> _Outbox:
        """Check the request, register its stream and queue it for the engine thread."""
        self.engine.validate(request, mode, prefill, lora)
        outbox = _Outbox(asyncio.get_running_loop())
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request_id: {request.request_id!r} is already running")
            self._streams[request.request_id] = outbox
        self._commands.put(AddRequest(request, mode, prefill, kv_export_start, lora))
        self._wake.set()
        return outbox

    async def _batches(self, request: GenerationRequest, outbox: _Outbox, prefill: PrefillResult | None
                       ) -> AsyncIterator[list]:
        """An opened stream's batches, until every choice has ended (or gone on to D); leaving
        early closes the stream (``close_stream``)."""
        remaining = {c.index for c in prefill.choices} if prefill is not None else set(range(request.n))
        if request.params.beam_width > 1:
            remaining = {0}  # beams end in one output
        done = False
        try:
            while not done:
                batch = await self._take(outbox)
                error = next((i for i, item in enumerate(batch) if isinstance(item, Exception)), None)
                if error is not None:
                    done = True
                    if error:
                        yield batch[:error]
                    raise batch[error]
                for output in batch:
                    if isinstance(output, RequestOutput) and (output.finished or output.prefill is not None):
                        remaining.discard(output.index)
                done = not remaining or isinstance(batch[-1], Moved)  # a move ends the stream here
                yield batch
        finally:
            if done:
                with self._lock:
                    self._streams.pop(request.request_id, None)
            else:
                self.close_stream(request.request_id)

    async def _take(self, outbox: _Outbox) -> list:
        """Everything delivered to ``outbox`` and not taken yet (waits for one item). Taking and
        clearing ``ready`` happen with no await between: a delivery after the take sets it again."""
        while True:
            with self._lock:
                batch, outbox.pending = outbox.pending, []
            outbox.ready.clear()
            if batch:
                return batch
            await outbox.ready.wait()

    # ---- the engine thread -------------------------------------------------------------

    def _run(self, config: EngineConfig, built: threading.Event, failure: list[BaseException]) -> None:
        """The engine thread: build the engine, then serve it (``_loop``). Every torch call of the
        engine runs on this one thread, its warm-up forward too: libgomp (torch's OpenMP) keeps one
        worker pool per thread that opens a parallel region, and once its threads outnumber the CPUs
        (a pool of 2 built on the server's thread beside the engine thread's, on 2 cores) its workers
        sleep on a futex at the end of each region instead of spinning to the next one, and each of a
        decode step's regions (a GEMV each, and more) pays a wake-up (benchmarks/RESULTS.md, issue 57 session 5:
        one stream on the engine thread 51 -> 86 tok/s in process)."""
        try:
            self.engine = LLMEngine(config)
            self._stats = self._snapshot()
        except BaseException as error:  # raised by __init__, on the caller's thread
            failure.append(error)
            return
        finally:
            built.set()
        self._loop()

    def _loop(self) -> None:
        while not self._stopped:
            if not self.engine.has_work() and self._commands.empty():
                # Requests waiting for their KV still expire at their deadline, prefix holds at theirs.
                polls = self.engine.scheduler.receiving or len(self.engine.holds)
                self._wake.wait(RECEIVING_POLL_S if polls else None)
            self._wake.clear()
            try:
                self._drain_commands()
                self._step()
            finally:
                self._flush()

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            if self._hang_s:
                hang, self._hang_s = self._hang_s, 0.0
                self._hang_over.wait(hang)
            outputs = self.engine.step()
        except Exception as error:  # keep serving: fail the running requests, not the server
            logger.exception("engine step failed")
            self._fail_all(error)
            return
        finally:
            self._step_started = None
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
            if isinstance(command, AddRequest):
                try:
                    self.engine.add_request(command.request, command.mode, command.prefill, command.kv_export_start,
                                            command.lora)
                except Exception as error:
                    self._deliver(command.request.request_id, error)
            elif isinstance(command, HoldPrefix):
                try:
                    result = self.engine.hold_prefix(command.request, command.lora, command.until)
                except Exception as error:
                    result = error
                command.loop.call_soon_threadsafe(_settle, command.answer, result)
            elif isinstance(command, ReceiveKV):
                self.engine.receive_kv(command.request_id, command.data)
            elif isinstance(command, MoveOut):
                self._move_out()
            elif isinstance(command, ImportPrefix):
                try:
                    self.engine.import_prefix(command.request_id, command.keys, command.first, command.data,
                                              command.until)
                except Exception:  # the request computes its prompt instead
                    logger.exception("importing %s's prefix from the prefix store failed", command.request_id)
            else:
                for output in self.engine.abort(command.request_id):
                    self._finished[output.finish_reason] += 1
                    self._deliver(output.request_id, output)

    def _move_out(self) -> None:
        for request_id in self.engine.active_request_ids():
            if (moved := self.engine.move_out(request_id)) is not None:
                self._deliver(request_id, moved)

    def _fail_all(self, error: Exception) -> None:
        for request_id in self.engine.active_request_ids():
            self.engine.abort(request_id)
            self._deliver(request_id, EngineError(f"engine step failed: {error}"))

    def _deliver(self, request_id: str, item) -> None:
        """Add ``item`` to its stream's outbox; the caller is woken at the next ``_flush``, unless
        it has not taken the outbox's earlier items yet (then it takes this one with them)."""
        with self._lock:
            outbox = self._streams.get(request_id)
            if outbox is None:
                return
            outbox.pending.append(item)
            if len(outbox.pending) == 1:
                self._to_wake.append(outbox)

    def _flush(self) -> None:
        """Wake the callers of this turn's deliveries: one call into each caller's loop."""
        if not self._to_wake:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[_Outbox]] = {}
        for outbox in self._to_wake:
            by_loop.setdefault(outbox.loop, []).append(outbox)
        self._to_wake = []
        for loop, outboxes in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake_loop, outboxes)
            except RuntimeError:  # that caller's loop has closed: nobody is left to read
                pass


def _wake_loop(outboxes: list[_Outbox]) -> None:
    """On a caller's loop: mark each outbox ready to take."""
    for outbox in outboxes:
        outbox.ready.set()


def _settle(future: asyncio.Future, result) -> None:
    """Set a future from the engine thread's answer (an exception is raised to its awaiter)."""
    if future.done():  # its awaiter was cancelled
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
