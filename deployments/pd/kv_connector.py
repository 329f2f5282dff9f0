"""The one seam through which a prompt's KV goes from P to D (docs/serving.md, "The KV hand-off").

Three sides, as vLLM's KV connector (scheduler side and worker side) and SGLang's sender and
receiver split the job:

- P, the sender (``send``): P's reply, carrying the KV's metadata but never its bytes, then the bytes;
- the ingress, the owner (``claim``, ``release``): it holds the bytes' handle from P's reply until a
  D replica has taken the request, and that handle keeps the bytes alive even if P dies;
- D, the receiver (``load``): it fetches the bytes, once its engine holds blocks for them, through
  ``fetch``: bounded by ``deadline_s`` from the moment the fetch starts (not from the request's
  arrival: it may first wait in D's queue), and counted while in flight and when it fails, by cause
  (``transfer_health``: /metrics and /health read it through the ingress's probe of D).

No transport writes into the engine's blocks: the bytes land in the transport's own buffer (the
object store's copy, the segment's mapping) and the engine copies them into the blocks in one step
once the fetch has ended (``receive_kv``), and drops bytes for a request that ended meanwhile. So a
fetch cancelled or past its deadline leaves blocks that are free to reuse at once; a transport that
wrote into blocks (RDMA) would have to hold them until it knows the transfer stopped.

The engine's side of the hand-off (D allocates blocks before the bytes move, the request waits in
``RECEIVING``, ``receive_kv``, aborts free the blocks) is in engine/ and knows no transport. The
transports: Ray's object store here (``ObjectStoreConnector``), POSIX shared memory in
deployments/pd/kv_direct.py; an app picks one with ``kv_transport`` (``make_kv_connector``). Another
transport implements ``KVConnector``'s six methods; the engine, the servers and the ingress stay as they are.

A running request that a draining D moves to another D (engine/running_export.py) takes the same
road, its KV by reference too: the draining D ``export``s the bytes and sends their handle in its
``Moved``; the ingress ``adopt``s them, i.e. owns them from there as it owns P's; the new D ``load``s them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import asyncio
from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, field, replace
import time
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np
import ray
from ray.serve.handle import DeploymentResponseGenerator

from deployments.failures import KVLeaseExpired
from deployments.ingress.tracing import KVTransfer
from engine.kv_transfer import KVPayload
from engine.outputs import PrefillResult, RequestOutput


@dataclass
class PrefillReply:
    """P's answer: each choice's first-token output and, unless P finished every choice, the
    handoff for D: the prefill result without its KV bytes. ``kv`` holds the transport's handle to
    those bytes (one for all choices), set by the ingress's ``claim`` (from P's item: an ObjectRef,
    or a shared-memory segment's descriptor); in a list, so that Ray passes an ObjectRef on to D
    instead of resolving it."""

    outputs: list[RequestOutput]
    handoff: PrefillResult | None = None  # its kv.data is None
    kv: list = field(default_factory=list)


class KVTransferTimeout(KVLeaseExpired):
    """D's fetch of a request's KV did not end within its deadline: the request is prefilled again."""


class KVConnector(ABC):
    """A transport for P's KV. One instance per process; each side calls only its own methods.
    ``deadline_s``: how long D's fetch of one request's KV may take from its start (the app's ``kv_lease_s``)."""

    def __init__(self, deadline_s: float = 30.0) -> None:
        self.deadline_s = deadline_s
        self.transfers = {"count": 0, "bytes": 0, "seconds": 0.0}  # D: fetches into this replica so far
        self.in_flight: dict[str, float] = {}  # D: request id -> time.monotonic() its fetch started
        self.failed: Counter[str] = Counter()  # D: fetches that did not end with the bytes, by cause
        self.hang_next_s = 0.0  # D: the next fetch's added delay (the tests' fault hook, DecodeServer.hang_next_fetch)

    async def fetch(self, request_id: str, reply: PrefillReply) -> tuple[np.ndarray, KVTransfer]:
        """D: ``load``, within ``deadline_s`` of its start (KVTransferTimeout otherwise: a replica
        failure, the request is prefilled again), counted in ``transfer_health``."""
        self.in_flight[request_id] = time.monotonic()
        try:
            return await asyncio.wait_for(self._delayed_load(reply), self.deadline_s)
        except TimeoutError:
            self.failed["deadline"] += 1
            raise KVTransferTimeout(f"the KV fetch did not end within {self.deadline_s:g} s of its start") from None
        except asyncio.CancelledError:  # the request ended while its KV was in transit (a client went away)
            self.failed["cancelled"] += 1
            raise
        except Exception as error:
            self.failed[type(error).__name__] += 1
            raise
        finally:
            del self.in_flight[request_id]

    async def _delayed_load(self, reply: PrefillReply) -> tuple[np.ndarray, KVTransfer]:
        if self.hang_next_s:
            delay, self.hang_next_s = self.hang_next_s, 0.0
            await asyncio.sleep(delay)
        return await self.load(reply)

    def transfer_health(self) -> dict:
        """D: ``transfers`` so far, fetches in flight now, the oldest one's age (s), those past
        ``deadline_s`` (a fetch whose cancellation did not take), and failures by cause."""
        now = time.monotonic()
        ages = [now - start for start in self.in_flight.values()]
        return {**self.transfers, "in_flight": len(ages), "oldest_s": max(ages, default=0.0),
                "past_deadline": sum(age > self.deadline_s for age in ages), "failed": dict(self.failed)}

    def _counted(self, transfer: KVTransfer) -> KVTransfer:
        """D: ``transfer`` added to ``transfers``."""
        self.transfers["count"] += 1
        self.transfers["bytes"] += transfer.nbytes
        self.transfers["seconds"] += transfer.end - transfer.start
        return transfer

    @abstractmethod
    def send(self, outputs: list[RequestOutput]) -> Iterator[Any]:
        """P: the items of P's stream for one request's ``prefill`` outputs (by choice index)."""

    @abstractmethod
    async def claim(self, call: DeploymentResponseGenerator, watch: Callable[[AsyncIterator], AsyncIterator]
                    ) -> PrefillReply:
        """The ingress: P's reply, read from its streaming call to P's ``prefill`` (which yields
        ``Accepted`` and heartbeats, then what ``send`` made) through ``watch`` (the ingress's watch
        for a stalled P, deployments/replicas/liveness.py), with the handle to the KV bytes in ``reply.kv``;
        the ingress owns them from here."""

    @abstractmethod
    def export(self, data: np.ndarray) -> Any:
        """A draining D: KV bytes [L, 2, T, Hkv, D] of a running request it moves (engine/running_export.py),
        put where the ingress can take them over, and their handle, small, to send in the ``Moved``
        instead of the bytes. The handle stays valid at least while this process lives: the ingress
        must ``adopt`` it before then (a draining D outlives its last request by its channel's linger)."""

    @abstractmethod
    async def adopt(self, handle: Any) -> list:
        """The ingress: ownership of moved KV bytes, from ``export``'s ``handle`` (deployments/pd/backends.py),
        as a handle it owns as ``claim``'s, for ``PrefillReply.kv``. A replica failure (the request's
        tokens are replayed) when the bytes are gone: the draining D's process ended first."""

    @abstractmethod
    def release(self, reply: PrefillReply) -> None:
        """The ingress: a D replica took the request and holds its own handle; drop ours."""

    @abstractmethod
    async def load(self, reply: PrefillReply) -> tuple[np.ndarray, KVTransfer]:
        """D: the KV bytes [L, 2, T, Hkv, D] and how their fetch went."""


class ObjectStoreConnector(KVConnector):
    """Ray's object store. P yields the bytes as a second item of its stream: Ray owns each item
    of a stream by the caller (the ingress), not by P's worker, and keeps it on P's node, so the KV
    stays readable if P's replica dies or is scaled down after it answered (a ``ray.put`` in P
    would lose it). numpy, so a reader on P's node gets the bytes without a copy. The object goes
    away with its last reference: the ingress's, dropped when D takes the request, and D's call's,
    when the request ends, however it ends."""

    def send(self, outputs: list[RequestOutput]) -> Iterator[PrefillReply | np.ndarray]:
        result = next((o.prefill for o in outputs if o.prefill is not None), None)
        outputs = [replace(o, prefill=None) for o in outputs]  # the KV bytes travel apart, once
        if result is None:
            yield PrefillReply(outputs)
            return
        yield PrefillReply(outputs, replace(result, kv=KVPayload(result.kv.meta, None)))
        yield result.kv.data

    async def claim(self, call: DeploymentResponseGenerator, watch: Callable[[AsyncIterator], AsyncIterator]
                    ) -> PrefillReply:
        async def resolved() -> AsyncIterator:  # P's items up to its reply, resolved; the KV's stays a reference
            items = await call._to_object_ref_gen()  # references to P's items: the bytes stay where they are
            while not isinstance(item := await (await anext(items)), PrefillReply):
                yield item  # Accepted, Heartbeat
            if item.handoff is not None:
                item.kv = [await anext(items)]  # the reference, not the bytes
            yield item

        async with aclosing(watch(resolved())) as replies:
            return await anext(replies)

    def export(self, data: np.ndarray) -> ray.ObjectRef:
        return ray.put(data)  # owned by the draining D: the object goes with its process

    async def adopt(self, handle: ray.ObjectRef) -> list:
        """A copy of D's object, owned by the ingress (freed with its last reference, as P's item
        is): Ray 2.56 removed ``ray.put(_owner=...)``, and no call reaches a D that Serve drains,
        so the ingress cannot own D's object itself. The read is zero-copy on D's node; an
        OwnerDiedError (a replica failure) when D's process ended first."""
        return [ray.put(await handle)]

    def release(self, reply: PrefillReply) -> None:
        reply.kv.clear()

    async def load(self, reply: PrefillReply) -> tuple[np.ndarray, KVTransfer]:
        start = time.time()
        data = await reply.kv[0]  # zero-copy for numpy when the object is on this node
        return data, self._counted(KVTransfer(data.nbytes, start, time.time()))


KV_TRANSPORTS = ("object_store", "shared_memory")


def make_kv_connector(transport: str = "object_store", lease_s: float = 30.0) -> KVConnector:
    """The app's ``kv_transport``'s connector; ``lease_s``: the app's ``kv_lease_s``."""
    from deployments.pd.kv_direct import SharedMemoryConnector  # it imports this module

    if transport == "object_store":
        return ObjectStoreConnector(lease_s)
    if transport == "shared_memory":
        return SharedMemoryConnector(lease_s)
    raise ValueError(f"kv_transport: must be one of {', '.join(KV_TRANSPORTS)}, got {transport!r}")
