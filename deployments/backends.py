"""How the ingress reaches the engines: colocated (one deployment) or disaggregated (P then D).

Both yield the engine's RequestOutputs, one per token. When the caller stops iterating
(a client went away), the call in flight is cancelled; Ray Serve cancels it in the replica,
where leaving the engine's stream aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

from ray.serve.handle import DeploymentHandle

from deployments.errors import KVLeaseExpired
from deployments.kv_connector import KVConnector, ObjectStoreConnector, PrefillReply
from deployments.liveness import watched
from deployments.tracing import KVTransfer, RequestTrace
from engine.outputs import RequestOutput
from engine.request import GenerationRequest


class ColocatedBackend:
    """One call per request, streamed. Requests and outputs are plain data, so the call goes
    by value over Ray Serve's replica-to-replica gRPC channel instead of as a Ray actor task:
    about 1 ms less to the first token (benchmarks/RESULTS.md). P and D cannot: their calls
    carry the KV's ObjectRef (docs/serving.md)."""

    def __init__(self, llm: DeploymentHandle, stall_timeout_s: float) -> None:
        self.handles = {"LLMServer": llm}
        self._generate = llm.options(stream=True, _by_reference=False).generate
        self.stall_timeout_s = stall_timeout_s

    async def stream(self, request: GenerationRequest, trace: RequestTrace | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs; ReplicaStalled if its replica stops mid-stream (liveness.py)."""
        async with aclosing(_cancel_on_exit(self._generate.remote(request))) as items:
            accepted = await anext(items)  # the one replica may be restarting: no bound but the deadline
            async for output in watched(items, self.stall_timeout_s, accepted.replica):
                if trace:
                    trace.record_prefill(output)
                yield output


class PDBackend:
    """The ingress orchestrates: P runs the prompt and returns each choice's first token at
    once; the ingress hands them to the client, then calls D with P's reply. P's KV goes from P to D
    through the KV connector (deployments/kv_connector.py): only its handle passes through here.

    The ingress owns the KV from P's reply until a D replica takes the request, so it outlives P's
    replica. A D replica must take the request within ``kv_lease_s``; one that does not (stalled,
    or never reached) has its call cancelled and the request fails with ``KVLeaseExpired``, a
    replica failure: deployments/migration.py prefills it again. One that stops once it has taken
    the request fails it with ``ReplicaStalled`` after ``stall_timeout_s`` (liveness.py)."""

    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, kv_lease_s: float,
                 stall_timeout_s: float) -> None:
        self.prefill, self.decode = prefill, decode
        self.kv_lease_s, self.stall_timeout_s = kv_lease_s, stall_timeout_s
        self.kv: KVConnector = ObjectStoreConnector()
        self.handles = {"PrefillServer": prefill, "DecodeServer": decode}

    async def stream(self, request: GenerationRequest, trace: RequestTrace | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """P's outputs, then D's; ``trace`` learns each engine's times and the KV fetch."""
        reply = await self.prefill_step(request)
        for output in reply.outputs:
            if trace:
                trace.record_prefill(output)
            yield output
        if reply.handoff is not None:
            async with aclosing(self.decode_step(request, reply, trace)) as outputs:
                async for output in outputs:
                    yield output

    async def prefill_step(self, request: GenerationRequest) -> PrefillReply:
        """P's reply, with the handle to its KV (owned here) when D is to go on."""
        call = self.prefill.options(stream=True).prefill.remote(request)
        try:
            return await self.kv.claim(call)
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def decode_step(self, request: GenerationRequest, reply: PrefillReply, trace: RequestTrace | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """D's outputs after P's ``reply``; KVLeaseExpired if no D takes the request within the lease."""
        async with aclosing(_cancel_on_exit(self.decode.options(stream=True).decode.remote(request, reply))) as items:
            try:
                accepted = await asyncio.wait_for(anext(items), self.kv_lease_s)  # D holds its own handle
            except TimeoutError:
                raise KVLeaseExpired(f"no decode replica took the request within the {self.kv_lease_s:g} s "
                                     "lease of its KV") from None
            self.kv.release(reply)
            async for item in watched(items, self.stall_timeout_s, accepted.replica):
                if isinstance(item, KVTransfer):
                    if trace:
                        trace.record_kv(item)
                    continue
                if trace:
                    trace.record_decode(item)
                yield item


async def _cancel_on_exit(responses) -> AsyncIterator[RequestOutput]:
    ended = False
    try:
        async for output in responses:
            yield output
        ended = True
    finally:
        if not ended:
            responses.cancel()


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams (the prompts of one completions request) as their outputs arrive:
    (stream index, output). An error in one stream ends them all; leaving early closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except Exception as error:
            await queue.put((i, error))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
