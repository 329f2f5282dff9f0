"""A /metrics scrape is not held by a replica that does not answer (the soak found it hanging while
a replica was SIGSTOPped: benchmarks/RESULTS.md, the chaos soak); each engine gauge reads its own
stats field, summed over the deployment's replicas (served: tests/test_faults.py)."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from deployments.ingress.metrics import IngressMetrics
from engine.async_engine import EngineStats


class Answering:
    """A deployment's ``.remote()`` call that answers at once."""

    def __init__(self, value) -> None:
        self.value = value

    def remote(self, pinned: str | None = None):
        async def answer():
            return self.value
        return answer()


class Replicas:
    """A deployment's ``replica_stats`` call: the replica it is pinned to answers with its id and
    stats; pinned to one that is gone (or to none), replica ``a`` answers, as Serve's router would."""

    def __init__(self, by_replica: dict[str, EngineStats]) -> None:
        self.by_replica = by_replica

    def remote(self, pinned: str | None = None):
        replica = pinned if pinned in self.by_replica else "a"

        async def answer():
            return replica, self.by_replica[replica]
        return answer()


class Silent:
    """A deployment's ``.remote()`` call to a stopped replica: it never answers."""

    def remote(self, pinned: str | None = None):
        return asyncio.get_running_loop().create_future()


def stats(blocks_used: int) -> EngineStats:
    return EngineStats(blocks_total=64, blocks_used=blocks_used, blocks_cached=0, waiting_by_priority={5: 1},
                       running=1, finished_by_reason={}, prefix_cache_queries=0, prefix_cache_hits=0,
                       prompt_tokens_computed=0, queued_prompt_tokens=0, spec_decode_num_drafts=0,
                       spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0, dtype="float32",
                       requests=1, prefix_holds=0)


def test_a_silent_replica_leaves_its_gauges_and_the_scrape_answers():
    backend = SimpleNamespace(handles={
        "PrefillServer": SimpleNamespace(replica_stats=Replicas({"a": stats(blocks_used=7)})),
        "DecodeServer": SimpleNamespace(replica_stats=Silent(), kv_transfers=Silent()),
    })
    metrics = IngressMetrics()
    # Far above the metrics' own bound (STATS_TIMEOUT_S); without one the scrape waits forever.
    text = asyncio.run(asyncio.wait_for(metrics.render(backend), 20)).decode()
    assert 'pdserve_kv_blocks{deployment="PrefillServer",state="used"} 7.0' in text
    assert 'deployment="DecodeServer"' not in text  # no answer: no gauge made up for it


def test_each_per_deployment_gauge_reads_its_own_stats_field():
    """The table (deployments/ingress/metrics.py METRICS) ties each gauge to its EngineStats field: distinct
    values in, each under its own metric name out."""
    distinct = replace(stats(blocks_used=7), running=3, prefix_cache_queries=11, prefix_cache_hits=5,
                       prompt_tokens_computed=13, spec_decode_num_drafts=2, spec_decode_num_draft_tokens=17,
                       spec_decode_num_accepted_tokens=9)
    backend = SimpleNamespace(handles={"DecodeServer": SimpleNamespace(replica_stats=Replicas({"a": distinct}),
                                                                       kv_transfers=Answering(None))})
    text = asyncio.run(IngressMetrics().render(backend)).decode()
    for name, value in (("pdserve_running_requests", 3), ("pdserve_prefix_cache_queries", 11),
                        ("pdserve_prefix_cache_hits", 5), ("pdserve_prompt_tokens_computed", 13),
                        ("pdserve_spec_decode_num_drafts", 2), ("pdserve_spec_decode_num_draft_tokens", 17),
                        ("pdserve_spec_decode_num_accepted_tokens", 9),
                        ("pdserve_kv_cache_usage_perc", distinct.kv_cache_usage)):
        assert f'{name}{{deployment="DecodeServer"}} {float(value)}' in text


def test_a_deployments_gauges_are_its_replicas_summed_each_counted_once():
    """Two replicas routed to, and one gone (its pinned call answered by another): counts and each
    dict's counts are added (a priority none waits in stays at 0), each replica once."""
    from deployments.pd import routing

    first = replace(stats(blocks_used=7), waiting_by_priority={1: 0, 5: 2}, finished_by_reason={"length": 3},
                    kv_tier={"hits": 2, "spills": 5})
    second = replace(stats(blocks_used=5), waiting_by_priority={1: 0, 5: 1}, finished_by_reason={"length": 1,
                                                                                                "stop": 2},
                     kv_tier={"hits": 1, "spills": 0})
    backend = SimpleNamespace(handles={"DecodeServer": SimpleNamespace(
        replica_stats=Replicas({"a": first, "b": second}), kv_transfers=Answering(None))})
    routing._routed["DecodeServer"] = {"a", "b", "gone"}
    try:
        text = asyncio.run(IngressMetrics().render(backend)).decode()
    finally:
        routing._routed.pop("DecodeServer")
    for sample in ('pdserve_kv_blocks{deployment="DecodeServer",state="used"} 12.0',
                   'pdserve_queue_depth{deployment="DecodeServer",priority="1"} 0.0',
                   'pdserve_queue_depth{deployment="DecodeServer",priority="5"} 3.0',
                   'pdserve_engine_requests_finished{deployment="DecodeServer",reason="length"} 4.0',
                   'pdserve_engine_requests_finished{deployment="DecodeServer",reason="stop"} 2.0',
                   'pdserve_running_requests{deployment="DecodeServer"} 2.0',
                   'pdserve_kv_tier{deployment="DecodeServer",event="hits"} 3.0',
                   'pdserve_kv_tier{deployment="DecodeServer",event="spills"} 5.0',
                   f'pdserve_kv_cache_usage_perc{{deployment="DecodeServer"}} {12 / 128}'):
        assert sample in text, sample
