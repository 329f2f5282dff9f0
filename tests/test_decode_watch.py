"""The ingress's watch of D and P (deployments/pd/decode_watch.py) and the KV lease's wait
(deployments/pd/backends.py), in-process: a replica that stops answering ages out of ``answering``
within stall_timeout_s, a dead one at once, one that answers again is back; one probe lost under a
burst does not call a live replica down; a D whose KV descriptor differs from P's is never
answering and is named; a request waiting for a D to take its KV gives up when D is down, not at
the end of its lease. The served tests (tests/test_faults.py, tests/test_stalls.py,
tests/test_compatibility_served.py) stop or mismatch real replicas."""

import asyncio
from types import SimpleNamespace
import time

import pytest

from deployments.pd import routing
from deployments.pd.backends import _taken
from ray.exceptions import RayActorError

from deployments.pd.compatibility import KVDescriptor
from deployments.pd.decode_watch import DEPLOYMENT, PREFILL, DecodeWatch
from deployments.failures import DecodeDown, KVLeaseExpired, replica_failed

STALL_S = 0.4
FETCHES = {"in_flight": 1, "oldest_s": 0.5, "past_deadline": 0, "failed": {"cancelled": 2}}  # each replica's
KV = KVDescriptor("tiny-llama", "w1", "float32", "float32", "t1", 16, "2 x 2 x 16", 2048,
                  "max_draft_tokens 8, prompt lookup 0", "off")


class Call:
    """A handle call's response: awaitable once, cancellable."""

    def __init__(self, answer) -> None:
        self.task = asyncio.ensure_future(answer)

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


class Decode:
    """A role's handle as the watch uses it: ``answering.remote(pinned=...)``. ``silent``: replicas
    that never answer (stopped); ``dead``: replicas whose calls fail at once; ``lost``: replicas whose
    next probe is never answered (lost in a burst) while the later ones are; ``kv``: each replica's
    descriptor (KV by default)."""

    def __init__(self, kv: dict | None = None) -> None:
        self.silent, self.dead, self.lost, self.asked = set(), set(), set(), []
        self.kv = kv or {}
        self.answering = self

    def remote(self, pinned=None) -> Call:
        self.asked.append(pinned)
        lost = pinned in self.lost
        self.lost.discard(pinned)

        async def answer():
            if pinned in self.dead:
                raise RayActorError()
            while pinned in self.silent or lost:  # a stopped replica answers once it runs again
                await asyncio.sleep(0.01)
            return SimpleNamespace(replica=pinned or "a", transfers=FETCHES, kv=self.kv.get(pinned, KV))
        return Call(answer())


@pytest.fixture
def two_replicas():
    routing._routed[DEPLOYMENT] = {"a", "b"}
    yield
    routing._routed.pop(DEPLOYMENT, None)
    routing._routed.pop(PREFILL, None)
    routing._paired.clear()


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
        assert watch.why_down() == "no decode replica answers"
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
        assert took < STALL_S / 2  # the failed probes said it (Ray's word that the replica died), not the silence
        routing._routed.pop(DEPLOYMENT)
        assert not DecodeWatch(Decode(), STALL_S / 4, STALL_S).down()  # nothing known: not down

    asyncio.run(run())


def test_one_probe_lost_under_a_burst_does_not_call_a_live_replica_down(two_replicas):
    async def run():
        decode = Decode()
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S)
        watch.down()
        await until(lambda: {"a", "b"} <= set(decode.asked))
        decode.lost = {"a", "b"}  # each replica's next probe is lost; the probe after it is answered
        asked = len(decode.asked)
        await until(lambda: len(decode.asked) >= asked + 4)  # a second probe went to each while the first hung
        await asyncio.sleep(2 * STALL_S)  # past stall_timeout_s since the lost probes
        assert watch.answering() == {"a", "b"} and not watch.down()
        decode.silent = {"a", "b"}  # now every probe misses: down after stall_timeout_s
        await until(watch.down)

    asyncio.run(run())


def test_a_d_whose_kv_means_something_else_than_ps_is_never_answering_and_is_named(two_replicas, caplog):
    async def run():
        routing._routed[PREFILL] = {"p"}
        other = KVDescriptor(**{**KV.__dict__, "block_size": 32})
        decode = Decode(kv={"b": other})
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S, prefill=Decode())
        watch.down()
        await until(lambda: watch.incompatible() != [])
        assert watch.answering() == {"a"} and not watch.down()
        assert routing._paired == {PREFILL: {"p"}, DEPLOYMENT: {"a"}}  # the routers take these alone
        assert watch.incompatible() == ["DecodeServer b: incompatible prefill/decode: block_size: P has 16, D has 32"]
        assert any("not paired: DecodeServer b" in r.getMessage() for r in caplog.records)
        decode.kv["a"] = other  # a restarts with b's block size: no D is paired, D is down (P serves alone)
        await until(watch.down)
        assert watch.why_down() == "incompatible prefill/decode: no decode replica is paired with a prefill replica"
        assert routing._paired == {PREFILL: None, DEPLOYMENT: set()}  # any P (alone), no D

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
