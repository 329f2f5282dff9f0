"""The role watch's probes (deployments/pd/decode_watch.py) where tests/test_decode_watch.py does not
look: a replica silent from its first probe, one whose probes keep failing with an error that is not a
replica failure, the KV fetches when no D answers, and why D is down when the unpaired replicas do not
answer either. Over the same fake handle; written for the survivors of `make mutants`'s roles part."""

import asyncio

from deployments.pd import routing
from deployments.pd.compatibility import KVDescriptor
from deployments.pd.decode_watch import DEPLOYMENT, NO_ANSWER, NO_PAIR, PREFILL, DecodeWatch
from tests.test_decode_watch import KV, STALL_S, Call, Decode, two_replicas, until  # noqa: F401  (a fixture)


class Erring(Decode):
    """``erring``: replicas whose engine refuses every probe (an error, not a replica failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.erring = set()

    def remote(self, pinned=None) -> Call:
        if pinned in self.erring:
            self.asked.append(pinned)

            async def refused():
                raise RuntimeError("the engine refused")
            return Call(refused())
        return super().remote(pinned)


def test_a_replica_silent_from_its_first_probe_is_down_after_the_stall_timeout(two_replicas):
    async def run():
        decode = Decode()
        decode.silent = {"a", "b"}
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S)
        assert not watch.down()  # each replica has stall_timeout_s from first sight
        await until(watch.down)
        assert watch.why_down() == NO_ANSWER

    asyncio.run(run())


def test_a_replica_whose_probes_keep_failing_is_down_and_back_once_it_answers(two_replicas):
    async def run():
        decode = Erring()
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S)
        watch.down()
        await until(lambda: {"a", "b"} <= set(decode.asked))
        decode.erring = {"a", "b"}
        await until(watch.down)
        decode.erring = set()
        await until(lambda: not watch.down())
        assert watch.answering() == {"a", "b"}

    asyncio.run(run())


def test_no_d_answering_has_no_kv_fetch_to_report(two_replicas):
    async def run():
        routing._routed[DEPLOYMENT] = set()
        watch = DecodeWatch(Decode(), STALL_S / 4, STALL_S)
        return watch.transfers()

    assert asyncio.run(run()) == {"in_flight": 0, "oldest_s": 0.0, "past_deadline": 0, "failed": {}}


def test_d_down_is_unpaired_only_while_an_unpaired_replica_answers(two_replicas):
    async def run():
        routing._routed[PREFILL] = {"p"}
        decode = Decode(kv={"b": KVDescriptor(**{**KV.__dict__, "block_size": 32})})
        watch = DecodeWatch(decode, STALL_S / 4, STALL_S, prefill=Decode())
        watch.down()
        await until(lambda: watch.incompatible() != [])
        assert watch.why_down() == NO_PAIR  # b answers but may not take P's KV
        decode.silent = {"a", "b"}
        await until(lambda: watch.down() and watch.why_down() == NO_ANSWER)

    asyncio.run(run())
