"""The KV hand-off through POSIX shared memory: P writes the bytes once into a file of /dev/shm,
D maps it; Ray carries only a small descriptor (docs/serving.md, "The KV hand-off").

Ray's object manager moves an object between raylets as chunked gRPC copies on the cores P
computes on (0.13-0.15 GB/s here, benchmarks/RESULTS.md). Raylets on one host share /dev/shm,
so a segment there is one ``write`` in P and one ``mmap`` in D, whichever raylet each runs on.
Ray Direct Transport does not fit Serve replicas (async actors; docs/serving.md says why).

Ownership, as the object store's references give it (the failure contract, docs/serving.md):

- P creates ``pdserve-kv-p<P's pid>-<id>`` and replies with its ``KVSegment``; the segment is a
  file, so it outlives P's process (a draining D writes a moved request's KV as P does, and its
  ``Moved`` carries the ``KVSegment``: ``export``, ``adopt``);
- the ingress's ``claim`` renames it ``pdserve-kv-i<ingress pid>-<id>`` and holds a
  ``SegmentLease``: the lease unlinks the segment when it is dropped, i.e. when the request is
  over on the ingress however it ended (finished, client gone, lease expired, D failed);
- D maps it and unlinks it at once (its pages live until D's mapping goes): the common end;
- a sweep, run by P at each send, unlinks what nobody can end any more: segments whose owner's
  process is gone, and P's own segments no ingress claimed within ``lease_s`` (its call was
  cancelled between P's reply and the ingress's read).

One host only: the descriptor names P's host, and a D or ingress on another host refuses the
request with ``KVUnreachable`` rather than reading nothing (use the object store across hosts).
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import astuple, dataclass, replace
import functools
import mmap
import os
from pathlib import Path
import socket
import time
from typing import AsyncIterator, Callable, Iterator
import uuid

import numpy as np

from deployments.failures import KVLeaseExpired
from deployments.pd.kv_connector import KVConnector, PrefillReply
from deployments.ingress.tracing import KVTransfer
from engine.kv_transfer import KVPayload
from engine.outputs import RequestOutput

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"


class KVUnreachable(RuntimeError):
    """P's segment is in another host's shared memory: this transport needs P, D and the ingress
    on one host. A deployment error, not a replica failure: the request is not moved."""


class KVSegmentGone(KVLeaseExpired):
    """P's segment was unlinked before it was read (its owner's process died and a sweep took it,
    or the ingress gave it up): the request is prefilled again, as after an expired lease."""


@dataclass(frozen=True)
class KVSegment:
    """Where P's KV bytes are: a file of ``SHM_DIR`` on ``host``, [L, 2, T, Hkv, D] of ``dtype``."""

    name: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # numpy's dtype.str, e.g. "<f4"; bf16 travels as "<i2" (engine/kv_transfer.py)
    host: str

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name


class SegmentLease:
    """The ingress's ownership of a segment: it unlinks the segment when dropped, as dropping an
    ObjectRef frees an object. Pickled (Ray sends the reply to D) it becomes the plain
    ``KVSegment``: D reads the segment but its copy of the handle owns nothing."""

    def __init__(self, segment: KVSegment) -> None:
        self.segment = segment

    def __reduce__(self):
        return KVSegment, astuple(self.segment)

    def __del__(self) -> None:
        self.segment.path.unlink(missing_ok=True)  # D (or a sweep) may have ended it first


class SharedMemoryConnector(KVConnector):
    """``KVConnector`` over /dev/shm. ``lease_s``: how long a segment P wrote may wait for an
    ingress to claim it before P's sweep takes it (the app's ``kv_lease_s``)."""

    def __init__(self, lease_s: float) -> None:
        super().__init__(lease_s)
        self.lease_s = lease_s

    def send(self, outputs: list[RequestOutput]) -> Iterator[PrefillReply]:
        result = next((o.prefill for o in outputs if o.prefill is not None), None)
        outputs = [replace(o, prefill=None) for o in outputs]
        if result is None:
            yield PrefillReply(outputs)
            return
        sweep(self.lease_s)
        segment = write_segment(result.kv.data)
        yield PrefillReply(outputs, replace(result, kv=KVPayload(result.kv.meta, None)), [segment])

    async def claim(self, call, watch: Callable[[AsyncIterator], AsyncIterator]) -> PrefillReply:
        async def items() -> AsyncIterator:  # every item is small: the bytes are not in the stream
            async for item in call:
                yield item

        async with aclosing(watch(items())) as replies:
            reply = await anext(replies)
        if reply.kv:
            reply.kv = [SegmentLease(_claimed(reply.kv[0]))]
        return reply

    def export(self, data: np.ndarray) -> KVSegment:
        return write_segment(data)  # named by the draining D's pid, as P's: a sweep takes it once D is gone

    async def adopt(self, handle: KVSegment) -> list:
        return [SegmentLease(_claimed(handle))]  # KVSegmentGone if a sweep took it first (D ended)

    def release(self, reply: PrefillReply) -> None:
        """A no-op: the ingress keeps its lease until the request is over, since a D that dies
        after taking the request but before mapping the segment would otherwise leave it behind.
        D unlinks the segment as soon as it has mapped it, so the lease rarely has anything to do."""

    async def load(self, reply: PrefillReply) -> tuple[np.ndarray, KVTransfer]:
        start = time.time()
        data = map_segment(reply.kv[0])
        return data, self._counted(KVTransfer(data.nbytes, start, time.time()))


@functools.cache
def host_id() -> str:
    """This host, as shared memory sees it: its name and this boot (two containers on one host
    differ by name; one name across a reboot differs by boot id)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def write_segment(data: np.ndarray) -> KVSegment:
    """P: ``data``'s bytes in a new segment, written once (one copy into the page cache)."""
    segment = KVSegment(f"{PREFIX}p{os.getpid()}-{uuid.uuid4().hex}", data.nbytes, tuple(data.shape),
                        data.dtype.str, host_id())
    fd = os.open(segment.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        segment.path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return segment


def map_segment(segment: KVSegment) -> np.ndarray:
    """D: the segment's bytes as a read-only array over a shared mapping (no copy: D's engine
    copies them into its blocks), then the segment unlinked; its pages go with the mapping."""
    _same_host(segment)
    try:
        fd = os.open(segment.path, os.O_RDONLY)
    except FileNotFoundError:
        raise KVSegmentGone(f"the KV segment {segment.name} is gone before it was read") from None
    try:  # MAP_POPULATE: the page tables are filled here, so the fetch's time is the fetch's
        mapped = mmap.mmap(fd, segment.nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
    finally:
        os.close(fd)
    segment.path.unlink(missing_ok=True)  # the ingress's lease or a sweep may have ended it first
    return np.frombuffer(mapped, np.dtype(segment.dtype)).reshape(segment.shape)


def sweep(lease_s: float) -> list[str]:
    """Unlink the segments nobody will end: their owner's process is gone, or this process wrote
    them as P more than ``lease_s`` ago and no ingress claimed them. Returns their names."""
    swept, now = [], time.time()
    for entry in os.scandir(SHM_DIR):
        owner = _owner(entry.name)
        if owner is None:
            continue
        role, pid = owner
        try:
            stale = not _alive(pid) or (role == "p" and pid == os.getpid()
                                        and now - entry.stat().st_mtime > lease_s)
        except FileNotFoundError:  # ended meanwhile
            continue
        if stale:
            Path(entry.path).unlink(missing_ok=True)
            swept.append(entry.name)
    return swept


def segments() -> list[str]:
    """The names of every pdserve KV segment on this host (the tests' leak check)."""
    return sorted(name for name in os.listdir(SHM_DIR) if _owner(name) is not None)


def _claimed(segment: KVSegment) -> KVSegment:
    """The ingress takes P's segment over: renamed with its own pid, so P's sweep leaves it."""
    _same_host(segment)
    claimed = replace(segment, name=f"{PREFIX}i{os.getpid()}-{segment.name.rsplit('-', 1)[1]}")
    try:
        os.rename(segment.path, claimed.path)
    except FileNotFoundError:
        raise KVSegmentGone(f"P's KV segment {segment.name} was swept before the ingress claimed it") from None
    return claimed


def _same_host(segment: KVSegment) -> None:
    if segment.host != host_id():
        raise KVUnreachable(f"kv_transport shared_memory: P's KV is in the shared memory of host {segment.host!r}, "
                            f"this process runs on {host_id()!r}; the transport needs P, D and the ingress on one "
                            "host (kv_transport: object_store moves KV between hosts)")


def _owner(name: str) -> tuple[str, int] | None:
    """("p" or "i", pid) of a segment's name, None if it is not one of ours."""
    if not name.startswith(PREFIX):
        return None
    owner = name[len(PREFIX):].split("-", 1)[0]
    if owner[:1] not in ("p", "i") or not owner[1:].isdigit():
        return None
    return owner[0], int(owner[1:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
