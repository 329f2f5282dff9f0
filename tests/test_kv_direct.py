"""The shared-memory KV connector (deployments/pd/kv_direct.py) in one process, without Ray: P's
``send``, the ingress's ``claim`` and D's ``load`` give D P's bytes bit for bit, and every way a
hand-off ends leaves no segment in /dev/shm. The Serve-level tests (parity with the object store
across raylets, P killed after its reply) are in tests/test_serve_multinode.py."""

import asyncio
import gc
import os
import multiprocessing
import pickle

import numpy as np
import pytest
from pydantic import ValidationError

from deployments.pd import kv_direct
from deployments.config import AppArgs
from deployments.failures import replica_failed
from deployments.pd.kv_connector import KVTransferTimeout, ObjectStoreConnector, PrefillReply, make_kv_connector
from deployments.pd.kv_direct import KVSegmentGone, KVUnreachable, SharedMemoryConnector, segments
from deployments.replicas.liveness import Accepted, taken_then_watched
from engine.kv_transfer import KVMeta, KVPayload
from engine.outputs import ChoiceStart, PrefillResult, RequestOutput

LEASE_S = 30.0


@pytest.fixture(autouse=True)
def no_segment_left() -> set[str]:
    """Each test leaves no pdserve segment of its own on this host (its leases dropped first); yields
    the segments there before it (another process of the host may hold some: never this test's)."""
    before = set(segments())
    yield before
    gc.collect()
    assert not set(segments()) - before


def p_outputs(data: np.ndarray) -> list[RequestOutput]:
    """P's first-token output of one choice, carrying ``data`` [L, 2, T, Hkv, D] as its KV."""
    meta = KVMeta("model", str(data.dtype), data.shape[0], data.shape[3], data.shape[4], data.shape[2])
    result = PrefillResult("r", [ChoiceStart(0, 5, None, 7)], KVPayload(meta, data), 1.0)
    return [RequestOutput("r", [5], "x", 1, False, None, 7, prefill=result)]


async def claimed(connector, items) -> PrefillReply:
    """The ingress's claim of P's stream: ``Accepted``, then ``items``."""
    async def call():
        yield Accepted("P")
        for item in items:
            yield item

    return await connector.claim(call(), lambda stream: taken_then_watched(stream, 5, lambda: None))


def at_d(reply: PrefillReply) -> PrefillReply:
    """The reply as D's call receives it: through pickle, as Ray sends it."""
    return pickle.loads(pickle.dumps(reply))


@pytest.mark.parametrize("dtype", [np.float32, np.int16])  # bf16 travels as int16 bits
def test_send_claim_load_gives_d_the_bytes_bit_for_bit_and_unlinks_them(dtype, no_segment_left):
    data = np.random.default_rng(0).standard_normal((4, 2, 37, 4, 32)).astype(np.float32).view(np.uint32)
    data = data.view(dtype) if dtype == np.float32 else data.astype(np.int16)
    connector = SharedMemoryConnector(LEASE_S)
    reply = asyncio.run(claimed(connector, connector.send(p_outputs(data))))
    assert reply.handoff.kv.data is None and reply.outputs[0].prefill is None  # the bytes are not in the reply
    (mine,) = set(segments()) - no_segment_left
    assert mine.startswith(f"pdserve-kv-i{os.getpid()}-")  # claimed
    connector.release(reply)  # D took the request
    loaded, transfer = asyncio.run(connector.load(at_d(reply)))
    assert not set(segments()) - no_segment_left  # D unlinked it once mapped
    assert loaded.dtype == data.dtype and loaded.shape == data.shape and loaded.tobytes() == data.tobytes()
    assert transfer.nbytes == data.nbytes and connector.transfers["count"] == 1


def test_a_request_that_ends_before_d_loads_unlinks_its_segment(no_segment_left):
    connector = SharedMemoryConnector(LEASE_S)
    reply = asyncio.run(claimed(connector, connector.send(p_outputs(np.ones((2, 2, 5, 1, 8), np.float32)))))
    sent = at_d(reply)  # D got the call, but it is aborted before the load (client gone, lease expired)
    assert len(set(segments()) - no_segment_left) == 1
    del reply  # the request is over on the ingress: its lease goes with it
    assert not set(segments()) - no_segment_left
    with pytest.raises(KVSegmentGone):
        asyncio.run(connector.load(sent))


def test_a_first_token_that_ends_the_request_writes_no_segment(no_segment_left):
    connector = SharedMemoryConnector(LEASE_S)
    (reply,) = connector.send([RequestOutput("r", [2], "", 1, True, "stop", 7)])
    assert reply.handoff is None and not reply.kv and not set(segments()) - no_segment_left


def p_then_exit(pipe) -> None:
    data = np.arange(4 * 2 * 50 * 4 * 32, dtype=np.float32).reshape(4, 2, 50, 4, 32)
    (reply,) = SharedMemoryConnector(LEASE_S).send(p_outputs(data))
    pipe.send(reply)


def p_in_a_process_that_exits() -> PrefillReply:
    """P's reply from a process that has exited once this returns (P died after its reply)."""
    receiving, sending = multiprocessing.Pipe(duplex=False)
    p = multiprocessing.get_context("fork").Process(target=p_then_exit, args=(sending,))
    p.start()
    reply = receiving.recv()  # our own child's reply, as Ray would carry it
    p.join(60)
    assert p.exitcode == 0
    return reply


def test_the_segment_of_a_p_that_died_after_its_reply_is_still_read():
    connector = SharedMemoryConnector(LEASE_S)
    reply = asyncio.run(claimed(connector, [p_in_a_process_that_exits()]))
    loaded, _ = asyncio.run(connector.load(at_d(reply)))
    assert np.array_equal(loaded, np.arange(loaded.size, dtype=np.float32).reshape(loaded.shape))


def test_a_sweep_takes_the_segment_of_a_dead_p_no_ingress_claimed_and_only_that(no_segment_left):
    connector = SharedMemoryConnector(LEASE_S)
    live = asyncio.run(claimed(connector, connector.send(p_outputs(np.ones((1, 2, 3, 1, 8), np.float32)))))
    orphan = p_in_a_process_that_exits().kv[0]  # P died; its reply never reached an ingress
    swept = kv_direct.sweep(LEASE_S)
    assert orphan.name in swept and live.kv[0].segment.name not in swept  # the claimed one's owner lives
    assert set(segments()) - no_segment_left == {live.kv[0].segment.name}
    del live


def test_a_sweep_takes_ps_own_segment_no_ingress_claimed_within_the_lease():
    connector = SharedMemoryConnector(LEASE_S)
    (unclaimed,) = connector.send(p_outputs(np.ones((1, 2, 3, 1, 8), np.float32)))  # the call was cancelled
    assert unclaimed.kv[0].name not in kv_direct.sweep(LEASE_S)  # within its lease: an ingress may still claim it
    os.utime(unclaimed.kv[0].path, (0, 0))  # written long ago
    assert unclaimed.kv[0].name in kv_direct.sweep(LEASE_S)


def test_a_d_on_another_host_refuses_the_request_naming_the_transport(monkeypatch):
    connector = SharedMemoryConnector(LEASE_S)
    reply = asyncio.run(claimed(connector, connector.send(p_outputs(np.ones((1, 2, 3, 1, 8), np.float32)))))
    monkeypatch.setattr(kv_direct, "host_id", lambda: "another-host/boot")
    with pytest.raises(KVUnreachable, match="kv_transport shared_memory.*one host"):
        asyncio.run(connector.load(at_d(reply)))


def test_the_app_picks_its_transport_and_refuses_an_unknown_one():
    assert isinstance(make_kv_connector(AppArgs().kv_transport), ObjectStoreConnector)
    args = AppArgs(kv_transport="shared_memory", kv_lease_s=7)
    connector = make_kv_connector(args.kv_transport, args.kv_lease_s)
    assert isinstance(connector, SharedMemoryConnector) and connector.lease_s == 7
    with pytest.raises(ValidationError, match="kv_transport"):
        AppArgs(kv_transport="nixl")
    with pytest.raises(ValueError, match="kv_transport: must be one of object_store, shared_memory"):
        make_kv_connector("nixl")


def test_d_fetch_is_bounded_from_its_own_start_counted_and_a_late_one_leaves_no_segment(no_segment_left):
    """The deadline starts when D's fetch starts, not when P replied: a fetch that waited longer than
    the deadline in D's queue still runs; one that does not end within it (the fault hook's delay, a
    stuck link) fails as a replica failure, counted by cause, and the request's segment goes with it."""
    connector = SharedMemoryConnector(0.3)
    data = np.ones((2, 2, 5, 1, 8), np.float32)

    async def queued_then_fetched():
        reply = await claimed(connector, connector.send(p_outputs(data)))
        await asyncio.sleep(0.5)  # in D's queue, past the deadline
        loaded, _ = await connector.fetch("r", at_d(reply))
        return loaded

    assert asyncio.run(queued_then_fetched()).tobytes() == data.tobytes()

    async def stuck():
        reply = await claimed(connector, connector.send(p_outputs(data)))
        connector.hang_next_s = 3600.0
        with pytest.raises(KVTransferTimeout) as late:
            await connector.fetch("r", at_d(reply))
        assert replica_failed(late.value) and connector.transfer_health()["failed"] == {"deadline": 1}

    asyncio.run(stuck())  # the ingress's lease ended with the request: its segment is gone (the fixture checks)
    assert connector.transfer_health()["in_flight"] == 0


def test_a_fetch_cancelled_in_transit_is_counted_and_leaves_no_segment(no_segment_left):
    connector = SharedMemoryConnector(LEASE_S)

    async def cancelled():
        reply = await claimed(connector, connector.send(p_outputs(np.ones((2, 2, 5, 1, 8), np.float32))))
        connector.hang_next_s = 3600.0
        fetch = asyncio.ensure_future(connector.fetch("r", at_d(reply)))
        while not connector.transfer_health()["in_flight"]:  # in transit: the fault happens mid-fetch
            await asyncio.sleep(0.01)
        assert connector.transfer_health()["oldest_s"] >= 0
        fetch.cancel()  # the client went away: Serve cancels D's call
        await asyncio.gather(fetch, return_exceptions=True)

    asyncio.run(cancelled())
    health = connector.transfer_health()
    assert health["failed"] == {"cancelled": 1} and health["in_flight"] == 0
