"""The pieces of stall detection (deployments/replicas/liveness.py) on their own: the server's heartbeats,
the ingress's watch, and the replicas the router prefers. tests/test_faults.py stops a real replica."""

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from deployments.failures import ReplicaStalled, replica_failed
from deployments.replicas.liveness import Heartbeat, heartbeats, preferred, watched


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
            assert not inner.closed
            seen.append(item)
            if len(seen) == 3:  # three heartbeats of silence, then the items come
                inner.go.set()
        assert inner.closed  # here, inside the loop: asyncio.run would close it on the way out
        return seen

    seen = asyncio.run(run())
    assert all(isinstance(item, Heartbeat) for item in seen[:3]) and seen[3:] == ["a", "b"]


def test_no_heartbeat_from_a_dead_engine_and_leaving_early_closes_the_stream():
    async def run():
        inner = Silent(["a"])
        outer = heartbeats(inner.stream(), 0.01, lambda: False)
        with pytest.raises(TimeoutError):  # silence: a dead engine thread says nothing
            await asyncio.wait_for(anext(outer), 0.2)
        # Checked here, with the loop still running: asyncio.run closes every open async
        # generator on its way out, so a check after it would pass whatever heartbeats did.
        assert inner.closed
        # A caller that leaves between items (the ingress's client went away) closes it too.
        kept = Silent(["a", "b"])
        kept.go.set()
        outer = heartbeats(kept.stream(), 0.01, lambda: True)
        assert await anext(outer) == "a" and not kept.closed
        await outer.aclose()
        assert kept.closed

    asyncio.run(run())


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
        assert silent.closed  # the stalled call is left (checked before asyncio.run closes it anyway)
        return passed, stalled.value

    passed, error = asyncio.run(run())
    assert passed == ["token", "last"]
    assert replica_failed(error)  # the request migrates

    fake = [SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda name=name: name))
            for name in (replica, "SERVE_REPLICA::test#DecodeServer#fine")]
    assert preferred(fake) == fake[1:]  # the stalled one gets no new request
    assert preferred(fake[:1]) == fake[:1]  # unless it is the only one


def as_replicas(*names: str) -> list:
    return [SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda name=name: name)) for name in names]


def test_a_replica_whose_stream_failed_because_it_died_gets_no_new_request_but_a_refusal_does_not_mark():
    died, refused, other = (f"SERVE_REPLICA::test#DecodeServer#{n}" for n in ("died", "refused", "other"))

    async def failing(error: Exception):
        yield "token"
        raise error

    async def run(replica: str, error: Exception) -> None:
        with pytest.raises(type(error)):
            async for _ in watched(failing(error), 30.0, replica):
                pass

    asyncio.run(run(died, ActorDiedError()))
    # A request error from a live replica (Serve wraps it in a RayTaskError) is not a failure of the replica.
    asyncio.run(run(refused, RayTaskError("decode", "traceback", ValueError("top_k: must be < 1024"))))
    replicas = as_replicas(died, refused, other)
    assert preferred(replicas) == replicas[1:]  # the migrated request goes to a live replica
