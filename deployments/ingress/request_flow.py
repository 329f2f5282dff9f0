"""A request's life in the ingress, in one place: one record per engine request and one task that
reads its backend's output batches (vLLM's ``RequestState`` and output loop, SGLang's ``ReqState``).

``RequestFlow`` holds what the ingress knows of a request: its admission ticket, its trace, each
choice's tokens so far (migration's resume point), the tokens to charge its key, and the generation
queue it delivers to. Its task reads the backend's batches (deployments/pd/backends.py) and, per
batch, updates all of these with plain method calls. A replica that fails mid-request is resumed
through migration's policy (deployments/ingress/migration.py). However the request ends (finished,
failed, cancelled because its client left), the task's end releases the ticket, ends the trace
and charges the key, each once.

The ingress owns the client's deadline: the engine ends a request at its first step past it, and a
replica failure past it ends the request as that step would have (no migration can answer in
time). A request that no engine has ended ``DEADLINE_GRACE_S`` after its deadline (a path that
waits on something that never answers) is ended here the same way, its backend stream closed.

``ServeGeneration`` is dialects/engine_client.py's Generation: it reads the queue its flows deliver
to, in arrival order. ``started`` holds the first-token rule: the generation is returned once every
request has its first output, and an error or a deadline passed before it is an HTTP error before
any byte (a 408 for the deadline). Nothing here knows a dialect: each failure is raised as what the
edge says a client is told of it (``told``: deployments/ingress/engine_client.py ``client_error``).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
import logging
import time
from typing import AsyncIterator, Callable

from deployments.failures import DeadlineBeforeFirstToken, LateReplacement, replica_failed, root_cause
from deployments.ingress.admission import Ticket
from deployments.ingress.migration import ChoiceSoFar, resume_legs, resumes
from deployments.ingress.streams import cancel_all
from deployments.ingress.tracing import RequestTrace
from engine.outputs import TIMEOUT, RequestOutput
from engine.request import GenerationRequest

logger = logging.getLogger("ray.serve." + __name__)
# request -> its output batches (the backend's ``stream``, its trace bound)
Start = Callable[[GenerationRequest], AsyncIterator[list[RequestOutput]]]
Told = Callable[[BaseException], Exception]  # a failure -> the error a client is told of it (the edge's)
ENDED = None  # a flow's last queue item
# How long past its deadline a request may run before the ingress ends it itself. The engine ends
# it at its first step past the deadline; a stalled replica is found within stall_timeout_s (5 s
# by default) and the request then ends here at once. Twice that bound: the ingress steps in only
# where nothing else will, never ahead of the engine's own ending, whose tokens it would cut.
DEADLINE_GRACE_S = 10.0


class RequestFlow:
    """One engine request in the ingress: its record and the task that reads its outputs."""

    def __init__(self, index: int, request: GenerationRequest, start: Start, trace: RequestTrace, ticket: Ticket,
                 max_migrations: int, end: Callable[[RequestFlow, str], None], queue: asyncio.Queue) -> None:
        """``index``: the request's place in its generation; ``end(flow, outcome)``: runs once when
        the task ends ("finished", "error" or "cancelled"); ``queue``: the generation's, fed
        (index, batch), (index, error) and (index, ENDED)."""
        self.index, self.request, self.start = index, request, start
        self.trace, self.ticket, self.max_migrations = trace, ticket, max_migrations
        self.so_far = [ChoiceSoFar(j, None) for j in range(request.n)]
        self.generated = 0  # tokens delivered: what the key is charged at the end
        self.first: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._end, self._queue = end, queue
        self.outcome = "cancelled"  # until the task says otherwise
        self.task = asyncio.create_task(self._run())
        # The end runs as the task's done callback: also when it is cancelled before it ever ran.
        self.task.add_done_callback(self._ended)

    async def _run(self) -> None:
        try:
            await self._served_by_deadline()
            self.outcome = "finished"
        except Exception as error:
            self.outcome = "error"
            if not self.first.done():
                self.first.set_exception(error)
            self._queue.put_nowait((self.index, error))

    def _ended(self, _task: asyncio.Task) -> None:
        """The ticket released, the trace ended and the key charged (by ``end``), once."""
        if not self.first.done():
            if self.outcome == "finished":
                self.first.set_exception(RuntimeError(f"the engine ended {self.request.request_id} without output"))
            else:
                self.first.cancel()
        self.ticket.done()
        self._end(self, self.outcome)
        self._queue.put_nowait((self.index, ENDED))

    async def _served_by_deadline(self) -> None:
        """``_serve``, ended by ``_time_out`` once ``DEADLINE_GRACE_S`` past the deadline: its
        backend streams are closed by the cancellation (their replicas abort it and free its KV)."""
        if self.request.deadline is None:
            return await self._serve()
        loop = asyncio.get_running_loop()
        watch = asyncio.timeout_at(loop.time() + self.request.deadline + DEADLINE_GRACE_S - time.time())
        try:
            async with watch:
                return await self._serve()
        except TimeoutError:
            if not watch.expired():
                raise
        logger.warning("request %s: no engine ended it %g s past its deadline; the ingress ends it as timed out",
                       self.request.request_id, DEADLINE_GRACE_S)
        self._time_out()

    def _time_out(self) -> None:
        """End each unfinished choice as the engine does at its deadline: a TIMEOUT output with
        no new token and the choice's tokens so far, which every dialect answers with its
        timeout error (a 408 before the first token)."""
        self._deliver([RequestOutput(self.request.request_id, [], "", len(c.token_ids), True, TIMEOUT, c.seed,
                                     output_token_ids=list(c.token_ids), text=c.text, index=c.index)
                       for c in self.so_far if not c.finished], None)

    async def _serve(self) -> None:
        """The request on the backend, resumed on another replica when one fails."""
        legs: list[tuple[GenerationRequest, int | None]] = [(self.request, None)]
        migrations = 0
        while True:
            # A replacement must answer before the deadline; the engine enforces it from then on.
            first_within = self.request.deadline - time.time() if migrations and self.request.deadline else None
            try:
                return await self._read_all(legs, first_within)
            except TimeoutError:
                if not migrations:
                    raise
                raise LateReplacement("no replica took over this request before its timeout; retry it") from None
            except Exception as error:
                if replica_failed(error) and self.request.deadline and time.time() >= self.request.deadline:
                    logger.warning("request %s: a replica failed (%s) past its deadline: it ends as timed out",
                                   self.request.request_id, type(root_cause(error)).__name__)
                    return self._time_out()
                if not resumes(error, migrations, self.max_migrations):
                    raise
                migrations += 1
                self.trace.migrations += 1
                legs = resume_legs(self.request, self.so_far, migrations)
                logger.warning("request %s: a replica failed (%s); migration %d of at most %d, %d choice(s) resumed",
                               self.request.request_id, type(root_cause(error)).__name__, migrations,
                               self.max_migrations, len(legs))

    async def _read_all(self, legs: list[tuple[GenerationRequest, int | None]], first_within: float | None) -> None:
        """Read every leg to its end; the first leg's error ends the others. One leg (the common
        path) is read in this task: no task of its own."""
        if len(legs) == 1:
            return await self._read(*legs[0], first_within)
        tasks = [asyncio.create_task(self._read(leg, carried, first_within)) for leg, carried in legs]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
        finally:
            await cancel_all(tasks)

    async def _read(self, leg: GenerationRequest, carried: int | None, first_within: float | None) -> None:
        """One engine request's batches, delivered; its first within ``first_within`` seconds if
        given (TimeoutError otherwise). ``carried``: the choice a resumed leg carries."""
        batches = self.start(leg)
        try:
            if first_within is not None:
                try:
                    self._deliver(await asyncio.wait_for(anext(batches), max(first_within, 0.0)), carried)
                except StopAsyncIteration:
                    return
            async for batch in batches:
                self._deliver(batch, carried)
        finally:
            await batches.aclose()

    def _deliver(self, batch: list[RequestOutput], carried: int | None) -> None:
        """A batch's outputs into the record (choices so far, trace, tokens) and onto the queue.
        Outputs of a resumed leg keep the request's id and their choice's index."""
        if carried is not None:
            batch = [replace(o, request_id=self.request.request_id, index=carried) for o in batch]
        for output in batch:
            self.so_far[output.index].record(output)
            self.trace.record_output(output)
            self.generated += len(output.new_token_ids)
        if not batch:
            return
        if not self.first.done():
            self.ticket.prefilled()  # the first token is out: P is done with the request
            self.first.set_result(batch[0])
        self._queue.put_nowait((self.index, batch))


class ServeGeneration:
    """dialects/engine_client.py's Generation: the outputs of its requests' flows, as they arrive;
    any failure out of them is raised as ``told(failure)``, what a client is told of it."""

    def __init__(self, flows: list[RequestFlow], queue: asyncio.Queue, told: Told) -> None:
        self._flows, self._queue, self.told = flows, queue, told

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            running = len(self._flows)
            while running:
                index, item = await self._queue.get()
                if item is ENDED:
                    running -= 1
                elif isinstance(item, Exception):
                    raise self.told(item) from None
                else:
                    for output in item:
                        yield index, output
        finally:
            await self.abort()  # a client that went away cancels the engines' calls at once

    async def abort(self) -> None:
        await cancel_all([flow.task for flow in self._flows])

    @property
    def ttft_s(self) -> float:
        return self._flows[0].trace.phases().get("ttft", 0.0)

    @property
    def last_gap_s(self) -> float:
        return self._flows[0].trace.last_gap


async def started(generation: ServeGeneration, flows: list[RequestFlow]) -> ServeGeneration:
    """``generation`` once every flow has its first output: the first-token rule. An error before
    it, and a deadline passed before it (``DeadlineBeforeFirstToken``: a 408), are raised as what the
    client is told of them (``generation.told``), before any byte; every flow is then cancelled."""
    try:
        firsts = await asyncio.gather(*(flow.first for flow in flows), return_exceptions=True)
        for first in firsts:
            if isinstance(first, BaseException):
                raise generation.told(first) from None
            if first.finished and first.finish_reason == TIMEOUT and not first.new_token_ids:
                raise generation.told(DeadlineBeforeFirstToken(
                    "request timed out: the request's timeout passed before its first token")) from None
    except BaseException:
        await generation.abort()
        raise
    return generation
