"""The stream plumbing of the ingress, one place for it: a Ray Serve call's items cancelled when
their reader leaves (``cancel_on_exit``), several streams interleaved (``merge``, ``indexed``), a
stream with its first output put back (``prepend_first``). Used by the backends, migration and the
engine client (deployments/pd/backends.py, migration.py, engine_client.py); the heartbeat watch that a
replica's stream is still alive is deployments/replicas/liveness.py's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine.outputs import RequestOutput


async def cancel_on_exit(responses) -> AsyncIterator:
    """A streaming Serve call's items; the call is cancelled if the reader leaves before its end."""
    ended = False
    try:
        async for output in responses:
            yield output
        ended = True
    finally:
        if not ended:
            responses.cancel()


async def prepend_first(first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The first output, then the rest of its stream."""
    try:
        yield first
        async for output in stream:
            yield output
    finally:
        await stream.aclose()


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
        await cancel_all(tasks)
        for stream in streams:
            await stream.aclose()


async def cancel_all(tasks) -> None:
    """Cancel ``tasks`` and wait until each has ended (its own cleanup run), whatever it raised."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def indexed(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``merge``'s (stream index, output); one stream is read directly: no task or queue on the
    common path."""
    return merge(streams) if len(streams) > 1 else _single(streams[0])


async def _single(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for output in stream:
            yield 0, output
    finally:
        await stream.aclose()
