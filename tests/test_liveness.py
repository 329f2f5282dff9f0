"""The pieces of stall detection (deployments/liveness.py) on their own: the server's heartbeats,
the ingress's watch, and the replicas the router prefers. tests/test_faults.py stops a real replica."""

import asyncio
from types import SimpleNamespace

import pytest

from deployments.failures import ReplicaStalled, replica_failed
from deployments.liveness import Heartbeat, heartbeats, preferred, watched


class Silent:
    """A stream that yields ``items`` once ``go`` is set, and records that it was closed."""

    def __init__(self, items: list) -> None:
        self.items, self.go, self.closed = items, asyncio.Event(), False

    async def stream(self):
        try:
            await self.go.wait()
            for item in self.items:
                yield item
        finally:
            self.closed = True


def test_a_silent_stream_gets_heartbeats_while_the_engine_runs_then_its_items_in_order():
    async def run():
        inner = Silent(["a", "b"])
        seen = []
        async for item in heartbeats(inner.stream(), 0.01, lambda: True):
            seen.append(item)
            if len(seen) == 3:  # three heartbeats of silence, then the items come
                inner.go.set()
        return seen

    seen = asyncio.run(run())
    assert all(isinstance(item, Heartbeat) for item in seen[:3]) and seen[3:] == ["a", "b"]


def test_no_heartbeat_from_a_dead_engine_and_leaving_early_closes_the_stream():
    async def run():
        inner = Silent(["a"])
        outer = heartbeats(inner.stream(), 0.01, lambda: False)
        with pytest.raises(TimeoutError):  # silence: a dead engine thread says nothing
            await asyncio.wait_for(anext(outer), 0.2)
        return inner

    assert asyncio.run(run()).closed


def test_the_watch_drops_heartbeats_and_raises_a_replica_failure_on_silence():
    replica = "SERVE_REPLICA::test#DecodeServer#stalls"

    async def run():
        beating = Silent([Heartbeat(), "token", Heartbeat(), "last"])
        beating.go.set()
        passed = [item async for item in watched(beating.stream(), 30.0, replica)]
        silent = Silent(["never"])
        with pytest.raises(ReplicaStalled) as stalled:
            async for _ in watched(silent.stream(), 0.05, replica):
                pass
        return passed, stalled.value, silent

    passed, error, silent = asyncio.run(run())
    assert passed == ["token", "last"]
    assert replica_failed(error) and silent.closed  # the request migrates; the stalled call is left

    fake = [SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda name=name: name))
            for name in (replica, "SERVE_REPLICA::test#DecodeServer#fine")]
    assert preferred(fake) == fake[1:]  # the stalled one gets no new request
    assert preferred(fake[:1]) == fake[:1]  # unless it is the only one
