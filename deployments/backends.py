"""How the ingress reaches the engines: colocated (one deployment) or disaggregated (P then D).

Both yield the engine's RequestOutputs, one per token. When the caller stops iterating
(a client went away), the call in flight is cancelled; Ray Serve cancels it in the replica,
where leaving the engine's stream aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ray.serve.handle import DeploymentHandle

from deployments.tracing import KVTransfer, RequestTrace
from engine.outputs import RequestOutput
from engine.request import GenerationRequest


class ColocatedBackend:
    """One call per request, streamed. Requests and outputs are plain data, so the call goes
    by value over Ray Serve's replica-to-replica gRPC channel instead of as a Ray actor task:
    about 1 ms less to the first token (benchmarks/RESULTS.md). P and D cannot: their calls
    carry the KV's ObjectRef (docs/serving.md)."""

    def __init__(self, llm: DeploymentHandle) -> None:
        self.handles = {"LLMServer": llm}
        self._generate = llm.options(stream=True, _by_reference=False).generate

    async def stream(self, request: GenerationRequest, trace: RequestTrace | None = None
                     ) -> AsyncIterator[RequestOutput]:
        async for output in _cancel_on_exit(self._generate.remote(request)):
            if trace:
                trace.record_prefill(output)
            yield output


class PDBackend:
    """The ingress orchestrates: P runs the prompt and returns each choice's first token at
    once; the ingress hands them to the client, then calls D with P's reply. P's KV goes from P to D
    through Ray's object store: only its ObjectRef passes through here."""

    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle) -> None:
        self.prefill, self.decode = prefill, decode
        self.handles = {"PrefillServer": prefill, "DecodeServer": decode}

    async def stream(self, request: GenerationRequest, trace: RequestTrace | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """P's outputs, then D's; ``trace`` learns each engine's times and the KV fetch."""
        response = self.prefill.prefill.remote(request)
        try:
            reply = await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        for output in reply.outputs:
            if trace:
                trace.record_prefill(output)
            yield output
        if reply.handoff is None:
            return
        async for item in _cancel_on_exit(self.decode.options(stream=True).decode.remote(request, reply)):
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
