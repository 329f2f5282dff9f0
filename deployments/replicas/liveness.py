"""Telling a stalled engine replica from a busy one, and routing around it.

A replica that stops (SIGSTOP, a hung host, a partitioned node) does not die, so Ray raises
nothing: its streams just wait. A gap between tokens cannot tell that apart from a request rightly
waiting behind higher priorities, so the replica says it is alive instead: while a stream has
nothing to send, the server yields a ``Heartbeat`` every ``heartbeat_s`` as long as its engine
thread runs (``heartbeats``). The ingress reads the stream through ``watched``: no item at all for
``stall_timeout_s`` (AppArgs) raises ``ReplicaStalled``, a replica failure, and the request
migrates (deployments/ingress/migration.py).

The ingress also marks the replica, and the engine deployments' Serve request router
(deployments/pd/routing.py, which runs in the ingress's process) gives it no new request for ``AVOID_S``
unless it is the only one left: without that, Serve's router, which sees only queue lengths, may send the
migrated request straight back to the stopped replica. A replica whose stream fails because it died
or cannot be reached is marked the same way: Serve's router keeps it until its controller notices,
and the prefix index ranks it first for the very prompt that moved.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import time
from typing import AsyncIterator, Callable

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.request_router import RunningReplica

from deployments.failures import ReplicaStalled, root_cause

AVOID_S = 30.0  # how long the ingress sends no new request to a replica that stalled one of its streams
_stalled_until: dict[str, float] = {}  # replica id -> time.monotonic() until which it is avoided (this process)


@dataclass
class Accepted:
    """An engine server's first item: it has taken the request. ``replica`` is its Serve id."""

    replica: str


@dataclass
class Heartbeat:
    """The server and its engine thread run; the stream has nothing to send yet."""


def replica_id() -> str:
    """The calling replica's id, as the router knows it."""
    return serve.get_replica_context().replica_id.to_full_id_str()


async def heartbeats(items: AsyncIterator, heartbeat_s: float, engine_alive: Callable[[], bool]) -> AsyncIterator:
    """``items``, with a Heartbeat after every ``heartbeat_s`` without one while ``engine_alive()``."""
    pending: asyncio.Task | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=heartbeat_s)
            if not done:
                if engine_alive():
                    yield Heartbeat()
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the stream ends early: stop the read in flight, then the stream
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await items.aclose()


async def watched(items: AsyncIterator, stall_timeout_s: float, replica: str) -> AsyncIterator:
    """``items`` without heartbeats; ReplicaStalled when nothing arrives for ``stall_timeout_s``."""
    while True:
        try:
            async with asyncio.timeout(stall_timeout_s):
                item = await anext(items)
        except StopAsyncIteration:
            return
        except TimeoutError:
            avoid(replica)
            raise ReplicaStalled(f"the replica serving this request gave no sign of life for "
                                 f"{stall_timeout_s:g} s") from None
        except Exception as error:
            if isinstance(root_cause(error), RayActorError):  # it died or cannot be reached
                avoid(replica)
            raise
        if not isinstance(item, Heartbeat):
            yield item


async def taken_then_watched(items: AsyncIterator, stall_timeout_s: float, routed_to: Callable[[], str | None]
                             ) -> AsyncIterator:
    """A call's items after its ``Accepted``, ``watched``; the call not taken within ``stall_timeout_s``
    (its replica is stopped before it could say so) raises ReplicaStalled and marks the replica its
    router chose for it (``routed_to()``, None if unknown). For P, whose calls Serve's router does
    not queue past the ingress's admission bound (deployments/ingress/admission.py), so a call not taken
    at once is a stall, not a queue."""
    try:
        async with asyncio.timeout(stall_timeout_s):
            accepted = await anext(items)
    except TimeoutError:
        if (replica := routed_to()) is not None:
            avoid(replica)
        raise ReplicaStalled(f"no replica took this request within {stall_timeout_s:g} s") from None
    async for item in watched(items, stall_timeout_s, accepted.replica):
        yield item


def avoid(replica: str) -> None:
    """No new request of this process goes to ``replica`` for ``AVOID_S`` (``preferred``)."""
    _stalled_until[replica] = time.monotonic() + AVOID_S


def preferred(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """The replicas no stream of this process found stalled in the last ``AVOID_S``; all of
    them if that leaves none (a lone replica is waited for, not refused)."""
    now = time.monotonic()
    live = [r for r in replicas if _stalled_until.get(r.replica_id.to_full_id_str(), 0.0) <= now]
    return live or replicas
