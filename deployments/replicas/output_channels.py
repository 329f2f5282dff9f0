"""One stream from each engine replica to each ingress, carrying every request's outputs.

A stream per request costs a replica one Ray Serve item per request per step (a gRPC message,
a wake-up of the replica's and the ingress's loops, under the GIL the engine thread needs): at 32
running requests, 32 items a step. A channel carries one ingress's outputs of a step, for all its
requests on that replica, in one item (SGLang's detokenizer and vLLM's output socket do the same
between their processes). Every engine role sends its outputs this way: the colocated engine, D
(after P's reply, its local prefill, alone) and P alone; only P's reply to the ingress is a call
of its own. The protocol, between a replica's ``ChannelSender`` and an ingress's ``ChannelReceiver``:

1. an accepting call, ``submit(request, channel)`` (or D's ``decode(request, reply, channel)``):
   routed as any request (prefix affinity and load, deployments/pd/routing.py), or pinned. The
   replica checks the request, starts it and answers ``Accepted``; the request's outputs go to
   ``channel`` (the ingress's id), keyed by request id (a migrated request runs under a new id: its
   old replica's late outputs never reach it).
2. ``channel(channel, pinned=replica)``: one streaming call per ingress and replica, opened by the
   ingress once a request was accepted there and none is open. It yields ``Accepted``, then dicts of
   request id -> the items made since the last item, in order (the engine's outputs; D's record of
   its KV fetch, a KVTransfer, before them; an ``Ended`` closes a request's list, with the error
   that ended it, if any), and a ``Heartbeat`` while there is nothing to send
   (deployments/replicas/liveness.py).
3. ``abort(channel, request_id)``: the reader of a request went away (its client left), or its
   acceptance came too late (D past the KV lease): the replica aborts it and frees its blocks.

A replica ends a channel once it has carried no request for ``CHANNEL_LINGER_S`` (so a replica
that Serve drains shuts down once its requests end); the ingress opens a new one for the requests
accepted meanwhile. A channel that fails (the replica died or stalled: no item for
``stall_timeout_s``) fails each of its requests as a replica failure, and they migrate
(deployments/ingress/migration.py); the replica cancels the requests of a channel whose reader left,
and of one that no reader opened within ``ORPHAN_S`` (its ingress died after submitting).

A failed channel is never read again: the ingress's later requests name a channel of a new id
(``ChannelReceiver``'s epochs). A replica that stalled goes on reading the old one until the
ingress's cancel reaches it, and what it reads meanwhile reaches no one: a request it accepted there
after the ingress gave the channel up (its answer was on the way) would wait for ever on a new
reader of that id, its outputs gone. Such a request fails with ``ChannelClosed`` instead, and moves.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, replace
import functools
import logging
import uuid
from typing import AsyncIterator, Awaitable, Callable

from ray.serve import context as serve_context

from deployments.failures import ChannelClosed, ChannelFailed, replica_failed, root_cause
from deployments.replicas.liveness import Accepted, taken_then_watched
from deployments.ingress.streams import cancel_on_exit
from engine.outputs import RequestOutput
from engine.request import GenerationRequest

logger = logging.getLogger("ray.serve." + __name__)
CHANNEL_LINGER_S = 2.0  # a channel without requests this long ends (the replica's side)
ORPHAN_S = 30.0  # a replica cancels the requests of a channel that no reader opened within this


@dataclass
class Ended:
    """The last item of a request on a channel: its stream ended, or failed with ``error``."""

    error: Exception | None = None


class _Channel:
    """One ingress's requests on this replica: the outputs not sent yet, and the tasks feeding them."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}  # request id -> outputs (and a final Ended) not sent yet
        self.ready = asyncio.Event()  # set when ``pending`` gains an item
        self.tasks: dict[str, asyncio.Task] = {}  # request id -> the task moving its outputs here
        self.reader = 0  # the generation of the reader now attached (0: none yet)

    def put(self, request_id: str, items: list) -> None:
        self.pending.setdefault(request_id, []).extend(items)
        self.ready.set()

    def take(self) -> dict[str, list]:
        items, self.pending = self.pending, {}
        self.ready.clear()
        return items


class ChannelSender:
    """A replica's channels, by the ingress's channel id (the ``submit``, ``channel`` and ``abort``
    of deployments/replicas/servers.py)."""

    def __init__(self, close_stream: Callable[[str], None], linger_s: float = CHANNEL_LINGER_S,
                 orphan_s: float = ORPHAN_S) -> None:
        """``close_stream(request_id)``: ends a request's engine stream (AsyncEngine.close_stream)."""
        self._close_stream = close_stream
        self.linger_s, self.orphan_s = linger_s, orphan_s
        self._channels: dict[str, _Channel] = {}
        self._readers = 0  # readers attached so far: each one's generation

    def start(self, channel_id: str, request_id: str, batches: AsyncIterator[list[RequestOutput]]) -> None:
        """Move an opened request's ``batches`` (AsyncEngine.open_batches) to ``channel_id``."""
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = _Channel()
            asyncio.get_running_loop().call_later(self.orphan_s, self._drop_orphan, channel_id, channel)
        channel.tasks[request_id] = asyncio.create_task(self._pump(channel, request_id, batches))

    async def _pump(self, channel: _Channel, request_id: str, batches: AsyncIterator[list]) -> None:
        try:
            async for batch in batches:
                channel.put(request_id, batch)
            channel.put(request_id, [Ended()])
        except Exception as error:  # the engine failed it: the ingress raises it as the request's error
            channel.put(request_id, [Ended(error)])
        finally:
            channel.tasks.pop(request_id, None)

    def abort(self, channel_id: str, request_id: str) -> None:
        """The ingress no longer reads ``request_id``: end it (its blocks are freed)."""
        channel = self._channels.get(channel_id)
        if channel is not None and request_id in channel.tasks:
            self._end(channel, request_id)
            channel.pending.pop(request_id, None)

    async def read(self, channel_id: str, heartbeat_s: float) -> AsyncIterator[dict[str, list] | None]:
        """The channel's items: every request's outputs since the last one, or None after
        ``heartbeat_s`` without any (the server turns it into a Heartbeat while its engine runs).
        Ends once the channel has had no request for ``linger_s``; leaving it early (the ingress
        closed it, or died, or found it stalled) cancels the channel's requests and forgets it,
        unless a newer reader took it over."""
        channel = self._channels.setdefault(channel_id, _Channel())
        self._readers += 1
        generation = channel.reader = self._readers
        idle_since = None
        try:
            while True:
                try:
                    await asyncio.wait_for(channel.ready.wait(), heartbeat_s)
                except TimeoutError:
                    pass
                if channel.reader != generation:  # a newer reader took the channel over: it takes the items
                    return
                if channel.pending:
                    yield channel.take()
                    idle_since = None
                    continue
                if not channel.tasks:
                    loop_time = asyncio.get_running_loop().time()
                    idle_since = idle_since or loop_time
                    if loop_time - idle_since >= self.linger_s:
                        return
                yield None
        finally:
            if channel.reader == generation:  # not taken over: no reader of this id comes again
                self._close(channel_id, channel)

    def _drop_orphan(self, channel_id: str, channel: _Channel) -> None:
        if not channel.reader:
            self._close(channel_id, channel)

    def _close(self, channel_id: str, channel: _Channel) -> None:
        """Forget ``channel`` (unless a new one took its id since) and end its requests."""
        if self._channels.get(channel_id) is channel:
            del self._channels[channel_id]
        for request_id in list(channel.tasks):
            self._end(channel, request_id)

    def _end(self, channel: _Channel, request_id: str) -> None:
        """Cancel a request's task and close its engine stream (a task cancelled before it ran
        never entered its stream, whose own cleanup would have closed it)."""
        channel.tasks.pop(request_id).cancel()
        self._close_stream(request_id)

    def open_channels(self) -> int:
        """Channels with a reader or requests on this replica (the tests' leak checks read it)."""
        return len(self._channels)


class ChannelReceiver:
    """An ingress's channels to the replicas of one engine deployment: each request's outputs,
    read from its replica's channel."""

    def __init__(self, handle, stall_timeout_s: float) -> None:
        """``handle``: the engine deployment's DeploymentHandle."""
        self._channel_prefix = uuid.uuid4().hex  # this ingress's channels are named "<prefix>.<epoch>"
        self._epoch = 0  # the channel new requests name; a new one once a reader of this one fails
        self._failed: dict[str, int] = {}  # replica id -> the latest epoch whose channel there failed
        self.stall_timeout_s = stall_timeout_s
        self.submit = handle.options(_by_reference=False).submit  # the default accepting call (``stream``)
        self._open = handle.options(stream=True, _by_reference=False).channel
        self._abort = handle.options(_by_reference=False).abort
        self._inboxes: dict[str, _Inbox] = {}  # request id -> its outputs, as the readers deliver them
        self._readers: dict[tuple[str, int], _Reader] = {}  # (replica id, epoch) -> the task reading that channel

    async def stream(self, request: GenerationRequest, accept: Callable[[str], Awaitable[Accepted]] | None = None,
                     taken: Callable[[Awaitable[Accepted]], Awaitable[Accepted]] | None = None
                     ) -> AsyncIterator[list]:
        """The request's outputs, in batches of what arrived since the last; its error when the
        engine ended it with one; a replica failure when its replica's channel fails
        (deployments/failures.py). ``accept(channel_id)``: the call that has a replica start the
        request with its outputs on this channel, and answers its ``Accepted`` (default: ``submit``,
        routed); ``taken(answer)``: waits for that answer (default: for as long as it takes; D's KV
        lease bounds it, deployments/pd/backends.py). Leaving early, or an answer past ``taken``'s
        bound, aborts the request once its replica has accepted it. ChannelClosed (a replica
        failure) when the channel it was accepted on failed before the request was read there: what
        the replica sent on it since may be lost (the module's docstring)."""
        inbox = self._inboxes[request.request_id] = _Inbox()
        accept = accept or functools.partial(self.submit.remote, request)
        epoch = self._epoch
        submitted = asyncio.ensure_future(detached(accept, self._channel_id(epoch)))
        reader, ended = None, False
        try:
            answer = asyncio.shield(submitted)
            accepted: Accepted = await (answer if taken is None else taken(answer))
            if self._failed.get(accepted.replica, -1) >= epoch:
                raise ChannelClosed("the channel this request was accepted on failed before it was read")
            reader = self._reader(accepted.replica, epoch)
            reader.requests.add(request.request_id)
            while not ended:
                batch, error = [], None
                for item in await inbox.take(reader):
                    if isinstance(item, Ended):
                        ended, error = True, item.error
                        break
                    batch.append(item)
                if batch:
                    yield batch
                if error is not None:
                    raise error
        finally:
            del self._inboxes[request.request_id]
            if reader is not None:
                reader.requests.discard(request.request_id)
            if not ended:
                self._abort_when_accepted(submitted, request.request_id, epoch)

    def _channel_id(self, epoch: int) -> str:
        return f"{self._channel_prefix}.{epoch}"

    def _abort_when_accepted(self, submitted: asyncio.Future, request_id: str, epoch: int) -> None:
        """Abort a request whose reader left, once its replica has accepted it (at once if it has),
        on the channel of ``epoch``, the one it was submitted to."""
        def abort(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                detached(self._abort.remote, self._channel_id(epoch), request_id, pinned=done.result().replica)

        submitted.add_done_callback(abort)

    def _reader(self, replica: str, epoch: int) -> _Reader:
        reader = self._readers.get((replica, epoch))
        if reader is None:
            reader = self._readers[replica, epoch] = _Reader(replica, epoch)
            # Not a child of the request that opens it (Serve cancels those with their parent).
            reader.task = asyncio.create_task(self._read(reader), context=contextvars.Context())
        return reader

    async def _read(self, reader: _Reader) -> None:
        """Deliver a replica's channel to its requests' inboxes until it ends; if it fails, fail
        them, and name a new channel for later requests; if the replica ended it while requests were
        accepted there, open it again for them."""
        call = self._open.remote(self._channel_id(reader.epoch), pinned=reader.replica)
        try:
            async for item in taken_then_watched(cancel_on_exit(call), self.stall_timeout_s, lambda: reader.replica):
                for request_id, outputs in item.items():
                    inbox = self._inboxes.get(request_id)
                    if inbox is not None:
                        inbox.put(outputs)
        except asyncio.CancelledError:  # the ingress shuts down
            reader.error = ChannelClosed("the ingress closed the channel to this request's replica")
            raise
        except Exception as error:
            # A request's own error comes as its Ended item; the call itself failing is the transport's or the
            # replica's failure (e.g. gRPC's RESOURCE_EXHAUSTED for an item past Serve's replica message limit,
            # RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH): its requests move, never a 500.
            reader.error = error if replica_failed(error) else ChannelFailed(
                f"the channel to this request's replica failed ({type(root_cause(error)).__name__})")
            logger.warning("the channel to replica %s failed (%s: %s): its %d request(s) move, and so do those it "
                           "takes until the failure reaches it", reader.replica, type(root_cause(error)).__name__,
                           str(error)[:200], len(reader.requests))
        finally:
            reader.ended = True
            del self._readers[reader.replica, reader.epoch]
            if reader.error is not None:
                self._failed[reader.replica] = max(self._failed.get(reader.replica, -1), reader.epoch)
                self._epoch = max(self._epoch, reader.epoch + 1)
            elif reader.requests:
                reader.moved_to = self._reader(reader.replica, reader.epoch)
                reader.moved_to.requests |= reader.requests
            for request_id in reader.requests:
                if (inbox := self._inboxes.get(request_id)) is not None:
                    inbox.wake()


def detached(call, *args, **kwargs):
    """``call(*args, **kwargs)`` as no Serve request's child, under the request's id (the
    replicas' logs name it): Serve cancels the calls a request made when it is cancelled (its
    client left), and an accepting call whose answer decides the abort, and the abort itself, must
    outlive the request that made them. Serve finds a request's children by its context: those made
    under ``cancel_on_parent_request_cancel`` once routed, and while being routed every call made
    under its internal id; the call gets an internal id of its own."""
    context = contextvars.copy_context()
    parent = context.get(serve_context._serve_request_context)
    if parent is not None:
        context.run(serve_context._serve_request_context.set,
                    replace(parent, cancel_on_parent_request_cancel=False, _internal_request_id=uuid.uuid4().hex))
    return context.run(call, *args, **kwargs)


class _Reader:
    """The ingress's reading of one replica's channel."""

    def __init__(self, replica: str, epoch: int) -> None:
        self.replica, self.epoch = replica, epoch  # the channel it reads: ChannelReceiver's epochs
        self.task: asyncio.Task | None = None  # held here: the event loop keeps only a weak reference
        self.requests: set[str] = set()  # ids of the requests accepted there and still read
        self.ended = False
        self.error: Exception | None = None  # why the channel failed, if it did
        self.moved_to: _Reader | None = None  # the channel opened again after this one ended


class _Inbox:
    """One request's outputs, delivered by its replica's reader."""

    def __init__(self) -> None:
        self.items: list = []
        self.ready = asyncio.Event()

    def put(self, items: list) -> None:
        self.items.extend(items)
        self.ready.set()

    def wake(self) -> None:
        self.ready.set()

    async def take(self, reader: _Reader) -> list:
        """Everything delivered and not taken yet (waits for one item); the channel's error once
        it failed with nothing left to take."""
        while True:
            if self.items:
                items, self.items = self.items, []
                self.ready.clear()
                return items
            while reader.moved_to is not None:
                reader = reader.moved_to
            if reader.ended and reader.error is not None:
                raise reader.error
            self.ready.clear()
            await self.ready.wait()
