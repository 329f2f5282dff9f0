"""The task and stream plumbing of the ingress: a Ray Serve call's items cancelled when their
reader leaves (``cancel_on_exit``), tasks cancelled and waited for (``cancel_all``). Used by the
backends, the output channels and the request flow; the heartbeat watch that a replica's stream is
still alive is deployments/replicas/liveness.py's.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator



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


async def cancel_all(tasks) -> None:
    """Cancel ``tasks`` and wait until each has ended (its own cleanup run), whatever it raised."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
