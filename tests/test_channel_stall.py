"""A replica stopped (SIGSTOP) across the moment the ingress gives its channel up, in process: the
race behind CI's hang of test_serve_pd.py's test_a_stream_whose_deadline_passes_ends_with_the_
dialects_error_event[chat] (no byte for 120 s once D ran again).

The ingress had D's channel open and idle when D stopped, D having taken the next request just
before (its answer on the way). The ingress found the channel stalled and cancelled it; D ran
again, its engine ended the request at once (its deadline had passed), and the channel's reader on
D, not yet told of the cancellation, sent the request's outputs on the call no one read. The answer
then reached the ingress, which read the request on a new reader of the same channel: it waited
for outputs that were gone, kept alive by that reader's heartbeats (deployments/replicas/output_channels.py)."""

import asyncio

import pytest

from deployments.failures import ChannelClosed
from deployments.replicas.liveness import Accepted, Heartbeat
from deployments.replicas.output_channels import ChannelReceiver, ChannelSender
from tests.test_output_channels import FakeStreams, Method, request_of, run

HEARTBEAT_S = 0.05
STALL_TIMEOUT_S = 1.0  # twenty heartbeats: a live channel in this loop never reaches it


class StoppableReplica:
    """One replica's ChannelSender behind a handle, run as Serve runs it: a channel call is read on
    the replica by a task of its own (``ServedCall``). While the replica is stopped (``running``
    cleared) it does nothing and sends nothing; its answers to accepting calls reach the caller
    only while ``answers`` is set; a cancelled call is read on until its cancellation reaches the
    replica (``cancellations``), and what it reads meanwhile is ``lost``."""

    REPLICA = "d1"

    def __init__(self, sender: ChannelSender, streams: FakeStreams) -> None:
        self.sender, self.streams = sender, streams
        self.running, self.answers, self.cancellations = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.running.set()
        self.answers.set()
        self.cancel_sent = asyncio.Event()  # the ingress cancelled a channel call
        self.cancelled_calls: list[ServedCall] = []
        self.lost: list = []
        self.aborted: list[str] = []
        self.tasks: list[asyncio.Task] = []  # held: the loop keeps only weak references
        self.submit, self.channel, self.abort = Method(self._submit), Method(self._channel), Method(self._abort)

    def options(self, **_):
        return self

    async def _submit(self, request, channel: str) -> Accepted:
        await self.running.wait()
        self.sender.start(channel, request.request_id, self.streams.open(request.request_id))
        await self.answers.wait()
        return Accepted(self.REPLICA)

    def _channel(self, channel: str, pinned: str) -> "ServedCall":
        return ServedCall(self, channel)

    def _abort(self, channel: str, request_id: str, pinned: str) -> None:
        self.aborted.append(request_id)
        self.sender.abort(channel, request_id)


class ServedCall:
    """A streaming call to ``StoppableReplica.channel``: the replica's reading of the channel, and
    what of it reached the caller."""

    def __init__(self, replica: StoppableReplica, channel: str) -> None:
        self.replica, self.cancelled = replica, False
        self.sent: asyncio.Queue = asyncio.Queue()  # None: the call ended
        self.served = asyncio.create_task(self._serve(channel))
        replica.tasks.append(self.served)

    async def _serve(self, channel: str) -> None:
        await self.replica.running.wait()
        self.sent.put_nowait(Accepted(self.replica.REPLICA))
        async for item in self.replica.sender.read(channel, HEARTBEAT_S):
            await self.replica.running.wait()
            (self.replica.lost.append if self.cancelled else self.sent.put_nowait)(item or Heartbeat())
        self.sent.put_nowait(None)

    def __aiter__(self):
        return self._items()

    async def _items(self):
        while (item := await self.sent.get()) is not None:
            yield item

    def cancel(self) -> None:
        self.cancelled = True
        self.replica.cancelled_calls.append(self)
        self.replica.cancel_sent.set()

        async def reaches_the_replica() -> None:
            await self.replica.cancellations.wait()
            await self.replica.running.wait()
            self.served.cancel()
        self.replica.tasks.append(asyncio.create_task(reaches_the_replica()))


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_a_request_taken_on_a_channel_the_ingress_gave_up_moves_and_later_ones_use_a_new_channel():
    async def scenario():
        streams = FakeStreams()
        replica = StoppableReplica(ChannelSender(streams.close, linger_s=60), streams)
        receiver = ChannelReceiver(replica, STALL_TIMEOUT_S)

        async def read(request_id: str) -> list:
            return [item async for batch in receiver.stream(request_of(request_id)) for item in batch]

        async def answer(request_id: str, *batches) -> None:
            await until(lambda: request_id in streams.queues)  # the replica took it
            for batch in (*batches, None):
                streams.queues[request_id].put_nowait(batch)

        opening = asyncio.create_task(read("w"))  # opens the channel, which stays open once w ended
        await answer("w", ["w1"])
        assert await opening == ["w1"]
        replica.running.clear()  # SIGSTOP: w's channel idle, x's call on its way
        replica.answers.clear()
        late = asyncio.create_task(read("x"))
        await replica.cancel_sent.wait()  # the ingress found the channel stalled
        replica.running.set()  # SIGCONT: x is taken; its deadline passed, it ends at once
        await answer("x", ["x1"])
        await until(lambda: any("x" in item for item in replica.lost if isinstance(item, dict)))
        replica.answers.set()  # x's answer reaches the ingress, then the cancellation the replica
        replica.cancellations.set()
        with pytest.raises(ChannelClosed):  # a replica failure: x moves (before: it waited for ever)
            await asyncio.wait_for(late, 10)
        later = asyncio.create_task(read("y"))
        await answer("y", ["y1"])
        await until(lambda: all(call.served.done() for call in replica.cancelled_calls))
        return await later, replica.aborted, replica.sender.open_channels()

    later, aborted, channels = run(scenario())
    assert later == ["y1"]  # on the channel of a new id
    assert aborted == ["x"]
    assert channels == 1  # the given-up channel closed once its cancellation came; the new one lingers
