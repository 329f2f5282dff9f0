"""The KV connector's deadlines and counters (deployments/pd/kv_connector.py) and the stall watch's
bounds (deployments/replicas/liveness.py), in one process over fake transports and streams: what
/metrics and /health read (fetches counted, bytes and seconds summed, failures by cause, fetches past
their deadline), the app's kv_lease_s reaching the connector, and a replica that never takes a call or
falls silent after taking it. Written for the survivors of `make mutants`'s roles part (docs/testing.md)."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from deployments.failures import ReplicaStalled
from deployments.ingress.tracing import KVTransfer
from deployments.pd import kv_connector
from deployments.pd.kv_connector import KVConnector, PrefillReply, make_kv_connector
from deployments.replicas import liveness
from deployments.replicas.liveness import Accepted, Heartbeat, heartbeats, taken_then_watched


class Clock:
    """time.monotonic for the connector's module: moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Fake(KVConnector):
    """A transport whose loads take ``seconds`` each (by their record) or raise ``errors`` in turn."""

    def __init__(self, deadline_s: float = 30.0, errors=()) -> None:
        super().__init__(deadline_s)
        self.errors = list(errors)

    def send(self, outputs):
        raise NotImplementedError

    async def claim(self, call, watch):
        raise NotImplementedError

    def export(self, data):
        raise NotImplementedError

    async def adopt(self, handle):
        raise NotImplementedError

    def release(self, reply):
        pass

    async def load(self, reply):
        if self.errors:
            raise self.errors.pop(0)
        data = np.zeros(reply.kv[0], np.uint8)
        return data, self._counted(KVTransfer(data.nbytes, 10.0, 10.5))


def fetch(connector: KVConnector, nbytes: int, request_id: str = "r"):
    return asyncio.run(connector.fetch(request_id, PrefillReply([], None, [nbytes])))


@pytest.mark.parametrize("transport", ["object_store", "shared_memory"])
def test_the_apps_kv_lease_is_the_connectors_fetch_deadline(transport):
    assert make_kv_connector(transport, 7.5).deadline_s == 7.5


def test_fetches_are_counted_with_their_bytes_and_seconds_and_failures_by_cause():
    connector = Fake(errors=[KeyError("gone"), KeyError("gone"), OSError("link")])
    assert connector.transfer_health() == {"count": 0, "bytes": 0, "seconds": 0.0, "in_flight": 0, "oldest_s": 0.0,
                                           "past_deadline": 0, "failed": {}}
    for _ in range(3):
        with pytest.raises((KeyError, OSError)):
            fetch(connector, 1)
    fetch(connector, 100)
    fetch(connector, 28)
    assert connector.transfer_health() == {"count": 2, "bytes": 128, "seconds": 1.0, "in_flight": 0, "oldest_s": 0.0,
                                           "past_deadline": 0, "failed": {"KeyError": 2, "OSError": 1}}


def test_cancelled_fetches_are_each_counted():
    connector = Fake()

    async def cancelled_twice():
        for _ in range(2):
            connector.hang_next_s = 3600.0
            task = asyncio.ensure_future(connector.fetch("r", PrefillReply([], None, [1])))
            while not connector.in_flight:
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled_twice())
    assert connector.transfer_health()["failed"] == {"cancelled": 2}


def test_the_fault_hooks_delay_holds_back_the_next_fetch_only():
    connector = Fake(deadline_s=60.0)
    connector.hang_next_s = 0.01
    fetch(connector, 1)
    assert connector.hang_next_s == 0.0  # the fetch after it starts at once


def test_a_fetch_in_flight_is_past_its_deadline_only_once_older_than_it(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(kv_connector, "time", SimpleNamespace(monotonic=clock.monotonic))
    connector = Fake(deadline_s=30.0)
    connector.in_flight = {"a": clock.now - 30.0, "b": clock.now - 31.0, "c": clock.now - 2.0}
    health = connector.transfer_health()
    assert (health["in_flight"], health["oldest_s"], health["past_deadline"]) == (3, 31.0, 1)


def test_a_call_no_replica_takes_is_a_stall_naming_its_bound_and_marks_the_routed_replica(monkeypatch):
    monkeypatch.setattr(liveness, "_stalled_until", {})

    async def never():
        await asyncio.Event().wait()
        yield None

    async def run():
        with pytest.raises(ReplicaStalled, match="no replica took this request within 0.05 s"):
            async for _ in taken_then_watched(never(), 0.05, lambda: "P#1"):
                pass

    asyncio.run(asyncio.wait_for(run(), 10.0))
    assert set(liveness._stalled_until) == {"P#1"}


def test_a_replica_silent_after_taking_the_call_is_a_stall_naming_its_bound(monkeypatch):
    monkeypatch.setattr(liveness, "_stalled_until", {})

    async def taken_then_silent():
        yield Accepted("D#2")
        yield Heartbeat()
        yield "token"
        await asyncio.Event().wait()

    async def run():
        seen = []
        with pytest.raises(ReplicaStalled, match="gave no sign of life for 0.05 s"):
            async for item in taken_then_watched(taken_then_silent(), 0.05, lambda: None):
                seen.append(item)
        return seen

    assert asyncio.run(asyncio.wait_for(run(), 10.0)) == ["token"]
    assert set(liveness._stalled_until) == {"D#2"}


def test_leaving_while_a_read_is_in_flight_closes_the_stream_without_an_error():
    closed = asyncio.Event()

    async def silent():
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            closed.set()

    async def run():
        outer = heartbeats(silent(), 0.01, lambda: True)
        assert isinstance(await anext(outer), Heartbeat)  # the read of the next item is in flight
        await outer.aclose()
        return closed.is_set()

    assert asyncio.run(asyncio.wait_for(run(), 10.0))
