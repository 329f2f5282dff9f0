"""The ingress's watch of D (deployments/pd/decode_watch.py) and the KV lease's wait
(deployments/pd/backends.py), in-process: a replica that stops answering ages out of ``answering``
within stall_timeout_s, a dead one at once, one that answers again is back; a request waiting for a
D to take its KV gives up when D is down, not at the end of its lease. The served tests
(tests/test_faults.py, tests/test_stalls.py) stop real D replicas."""

import asyncio
from types import SimpleNamespace
import time

import pytest

from deployments.pd import routing
from deployments.pd.backends import _taken
from deployments.pd.decode_watch import DEPLOYMENT, DecodeWatch
from deployments.failures import DecodeDown, KVLeaseExpired, replica_failed

STALL_S = 0.4
FETCHES = {"in_flight": 1, "oldest_s": 0.5, "past_deadline": 0, "failed": {"cancelled": 2}}  # each replica's


class Call:
    """A handle call's response: awaitable once, cancellable."""

    def __init__(self, answer) -> None:
        self.task = asyncio.ensure_future(answer)

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


class Decode:
    """D's handle as the watch uses it: ``answering.remote(pinned=...)``. ``silent``: replicas that
    never answer (stopped); ``dead``: replicas whose calls fail at once."""

    def __init__(self) -> None:
        self.silent, self.dead, self.asked = set(), set(), []
        self.answering = self

    def remote(self, pinned=None) -> Call:
        self.asked.append(pinned)

        async def answer():
            if pinned in self.dead:
                raise ConnectionError("died")
            while pinned in self.silent:  # a stopped replica answers once it runs again
                await asyncio.sleep(0.01)
            return SimpleNamespace(replica=pinned or "a", transfers=FETCHES)
        return Call(answer())


@pytest.fixture
def two_replicas():
    routing._routed[DEPLOYMENT] = {"a", "b"}
    yield
    routing._routed.pop(DEPLOYMENT, None)


async def until(predicate, timeout_s: float = 10.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_d_is_down_once_no_replica_answered_for_the_stall_timeout_and_back_when_one_answers(two_replicas):
    async def run():
        decode = Decode()
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S)
        assert not watch.down()
        await until(lambda: {"a", "b"} <= set(decode.asked))
        decode.silent = {"a"}
        await until(lambda: watch.answering() == {"b"})
        assert not watch.down()  # one replica answers: PD goes on
        assert watch.transfers() == FETCHES  # b's alone: a silent replica's last word is not counted
        decode.silent = {"a", "b"}
        took = await until(watch.down)
        assert took <= STALL_S + 0.2  # its last answer was at most a probe's period before the stop
        asked = len(decode.asked)
        await asyncio.sleep(STALL_S)
        assert len(decode.asked) == asked  # a silent replica is not sent probe after probe
        decode.silent = {"a"}  # b runs again: its probe in flight returns
        routing._routed[DEPLOYMENT] = {"a", "b", "c"}  # and a replacement joins
        await until(lambda: watch.answering() == {"b", "c"})
        assert not watch.down()
        await until(lambda: watch.transfers()["in_flight"] == 2)  # once c's first answer is in
        assert watch.transfers() == {"in_flight": 2, "oldest_s": 0.5, "past_deadline": 0, "failed": {"cancelled": 4}}

    asyncio.run(run())


def test_a_dead_replica_is_down_at_once_and_before_the_router_knows_d_nothing_is(two_replicas):
    async def run():
        decode = Decode()
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S)
        watch.down()
        await until(lambda: {"a", "b"} <= set(decode.asked))
        decode.dead = {"a", "b"}
        took = await until(watch.down)
        assert took < STALL_S / 2  # the failed probes said it, not the silence
        routing._routed.pop(DEPLOYMENT)
        assert not DecodeWatch(Decode(), STALL_S / 4, STALL_S).down()  # nothing known: not down

    asyncio.run(run())


def test_a_request_waiting_for_a_d_gives_up_when_d_is_down_else_at_its_lease():
    async def never():
        await asyncio.Event().wait()

    async def soon(value):
        await asyncio.sleep(0.01)
        return value

    async def run():
        assert await _taken(soon("accepted"), 5.0, never) == "accepted"
        waiting = asyncio.ensure_future(never())
        with pytest.raises(DecodeDown) as down:
            await _taken(waiting, 5.0, lambda: soon(None))
        assert waiting.cancelled() and replica_failed(down.value)  # the call is dropped; the request moves
        with pytest.raises(KVLeaseExpired):
            await _taken(never(), 0.05, never)

    asyncio.run(run())
