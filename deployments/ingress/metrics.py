"""The ingress's Prometheus metrics (GET /metrics).

Requests by endpoint, status and priority; per engine request, once each, the phase times
of deployments/ingress/tracing.py (queue by stage, prefill, decode, KV transfer seconds and bytes,
time to first token, time per output token, end to end); and, read from the engine
deployments at scrape time, queue depth
by priority, KV blocks used / cached / free and the usage fraction, prefix-cache queries and
hits (tokens, as vLLM counts them), speculative decoding's drafts and accepted tokens (as
vLLM names them), requests ended by finish reason, and KV bytes moved from P to D; and, in PD,
where each prompt was computed and why (``prefill_only``: P served it whole, no D answering;
``decode_only``: D did, no P answering), how many D and P replicas answer, and whose its tokens were.
Deployment figures are the sum over the deployment's replicas, each asked at each scrape (a
replica that does not answer within ``STATS_TIMEOUT_S`` is left out of that scrape).
"""

from __future__ import annotations

import asyncio
from dataclasses import fields, replace
import time
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deployments.ingress.health import app_deployments
from deployments.pd import routing
from deployments.ingress.tracing import RequestTrace

STATUS_TIMEOUT_S = 5.0  # Serve's status, read at each scrape for the replica counts
# A deployment's stats, read at each scrape: a replica that does not answer in time (stalled,
# SIGSTOPped) leaves its gauges at their last values instead of holding the scrape with it.
STATS_TIMEOUT_S = 2.0
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BYTES_BUCKETS = tuple(4 ** k * 1024 for k in range(1, 12))  # 4 KiB .. 4 GiB


class Metric(NamedTuple):
    """One declared metric. ``phase``: the trace phase (deployments/ingress/tracing.py) a histogram observes
    once per engine request; ``stat``: the EngineStats field a per-deployment gauge reads at each scrape."""

    attr: str  # IngressMetrics' attribute
    kind: type
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    phase: str | None = None
    stat: str | None = None


DEPLOYMENT = ("deployment",)
METRICS = (
    Metric("requests", Counter, "pdserve_requests", "HTTP requests", ("endpoint", "status", "priority")),
    Metric("ttft", Histogram, "pdserve_time_to_first_token_seconds", "arrival at the ingress to the first token",
           buckets=LATENCY_BUCKETS, phase="ttft"),
    Metric("tpot", Histogram, "pdserve_time_per_output_token_seconds", "mean time per token after the first",
           buckets=LATENCY_BUCKETS),
    Metric("e2e", Histogram, "pdserve_e2e_request_latency_seconds", "arrival at the ingress to the request's end",
           buckets=LATENCY_BUCKETS),
    Metric("queue_time", Histogram, "pdserve_request_queue_time_seconds", "waiting: ingress (to the engine), "
           "prefill (P or colocated: to scheduled), decode (D: to scheduled)", ("stage",), buckets=LATENCY_BUCKETS),
    Metric("prefill_time", Histogram, "pdserve_request_prefill_time_seconds", "scheduled to the first token",
           buckets=LATENCY_BUCKETS, phase="prefill"),
    Metric("decode_time", Histogram, "pdserve_request_decode_time_seconds", "first token to last token",
           buckets=LATENCY_BUCKETS, phase="decode"),
    Metric("kv_seconds", Histogram, "pdserve_kv_transfer_seconds", "D's fetch of a request's KV from P",
           buckets=LATENCY_BUCKETS, phase="kv_transfer"),
    Metric("kv_bytes_hist", Histogram, "pdserve_kv_transfer_bytes", "bytes of a request's KV fetched by D",
           buckets=BYTES_BUCKETS),
    Metric("queue_depth", Gauge, "pdserve_queue_depth", "requests waiting in an engine", ("deployment", "priority")),
    Metric("running", Gauge, "pdserve_running_requests", "requests running in an engine", DEPLOYMENT,
           stat="running"),
    Metric("kv_blocks", Gauge, "pdserve_kv_blocks", "KV cache blocks", ("deployment", "state")),
    Metric("finished", Gauge, "pdserve_engine_requests_finished", "requests an engine has ended since it started",
           ("deployment", "reason")),
    Metric("kv_tier", Gauge, "pdserve_kv_tier", "the second KV tier behind each pool (kv_tier_gb, docs/serving.md), "
           "since start: hits, spills, copy_backs and evictions in blocks, spilled_bytes and copied_back_bytes",
           ("deployment", "event")),
    Metric("kv_usage", Gauge, "pdserve_kv_cache_usage_perc", "fraction of KV blocks held by requests (cached "
           "blocks count as free)", DEPLOYMENT, stat="kv_cache_usage"),
    Metric("prefix_queries", Gauge, "pdserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
           DEPLOYMENT, stat="prefix_cache_queries"),
    Metric("prefix_hits", Gauge, "pdserve_prefix_cache_hits", "prompt tokens found in the prefix cache",
           DEPLOYMENT, stat="prefix_cache_hits"),
    Metric("prompt_computed", Gauge, "pdserve_prompt_tokens_computed", "prompt tokens run through the model "
           "(not prefix hits, not imported KV)", DEPLOYMENT, stat="prompt_tokens_computed"),
    Metric("spec_drafts", Gauge, "pdserve_spec_decode_num_drafts", "steps of a sequence that verified draft tokens",
           DEPLOYMENT, stat="spec_decode_num_drafts"),
    Metric("spec_draft_tokens", Gauge, "pdserve_spec_decode_num_draft_tokens", "draft tokens verified",
           DEPLOYMENT, stat="spec_decode_num_draft_tokens"),
    Metric("spec_accepted", Gauge, "pdserve_spec_decode_num_accepted_tokens", "draft tokens that stood",
           DEPLOYMENT, stat="spec_decode_num_accepted_tokens"),
    Metric("migrations", Counter, "pdserve_request_migrations", "times a request moved to another replica after "
           "the one serving it failed"),
    Metric("kv_bytes", Gauge, "pdserve_kv_bytes_moved", "KV bytes moved from P to D"),
    Metric("kv_transfers", Gauge, "pdserve_kv_transfers", "KV transfers from P to D"),
    Metric("replicas", Gauge, "pdserve_replicas", "running replicas of each deployment of this application (P:D "
           "ratio under autoscaling)", DEPLOYMENT),
    Metric("pd_decisions", Gauge, "pdserve_pd_prefill_decisions", "PD requests by where their prompt was computed "
           "(decode: on D, prefill: on P) and why (deployments/pd/disaggregation.py)", ("where", "reason")),
    Metric("pd_decode_answering", Gauge, "pdserve_pd_decode_replicas_answering", "PD: decode replicas that "
           "answered the ingress's probe within stall_timeout_s and are paired with P (deployments/pd/"
           "compatibility.py); 0: P serves alone (prefill_only decisions) or, "
           "degradation off, requests get a 503"),
    Metric("pd_prefill_answering", Gauge, "pdserve_pd_prefill_replicas_answering", "PD: prefill replicas that "
           "answered the ingress's probe within stall_timeout_s and are paired; 0: D serves alone "
           "(decode_only decisions) or, degradation off, requests get a 503"),
    Metric("kv_in_flight", Gauge, "pdserve_kv_transfers_in_flight", "PD: KV fetches D replicas have started and "
           "not ended (every D replica answering the ingress's probe)"),
    Metric("kv_oldest", Gauge, "pdserve_kv_transfer_oldest_seconds", "PD: age of the oldest KV fetch in flight"),
    Metric("kv_past_deadline", Gauge, "pdserve_kv_transfers_past_deadline", "PD: KV fetches in flight past their "
           "deadline (kv_lease_s from their start): a stuck transfer path"),
    Metric("kv_failed", Gauge, "pdserve_kv_transfers_failed", "PD: KV fetches that ended without the bytes, by "
           "cause (deadline, cancelled: the request ended meanwhile, or the error's name)", ("cause",)),
    Metric("prefix_store_blocks", Gauge, "pdserve_prefix_store_blocks", "PD: the app's prefix store (docs/serving.md): "
           "blocks published, found by look-ups (hit_blocks), pulled, evicted, and held now", ("event",)),
    Metric("prefix_store_calls", Gauge, "pdserve_prefix_store_calls", "PD: prefix store look-ups (lookups), those "
           "that found at least one block (hits), and pulls", ("event",)),
    Metric("prefix_store_bytes", Gauge, "pdserve_prefix_store_bytes", "PD: bytes the prefix store holds (within "
           "prefix_store_mib), and those of evicted blocks a pull still reads (kept_for_pulls)", ("kind",)),
    Metric("kv_moves", Gauge, "pdserve_kv_moves", "PD: running requests' choices moved off a draining decode "
           "replica to another (choices), the KV bytes they carried (bytes), and moves the new replica did not take "
           "over (failed: their tokens were replayed)", ("event",)),
    Metric("pd_prompt_tokens", Gauge, "pdserve_pd_prompt_tokens", "PD prompt tokens by who had them: decode_cache "
           "(D held their KV), decode (D computed them), prefill (P computed and sent them)", ("source",)),
)


async def deployment_stats(handle, deployment: str):
    """The engine stats of ``deployment``'s replicas summed (counts and the dicts' counts added): each
    replica this process routes to asked pinned, each answer counted once by the replica id it names
    (a pinned call to a replica gone reaches another). Raises when none answers in time."""
    running = sorted(routing.routed_replicas(deployment) or ()) or [None]  # None: any, before routing learnt them
    answers = await asyncio.gather(*(asyncio.wait_for(handle.replica_stats.remote(pinned=r), STATS_TIMEOUT_S)
                                     for r in running), return_exceptions=True)
    by_replica = dict(a for a in answers if not isinstance(a, BaseException))
    if not by_replica:
        raise next(a for a in answers if isinstance(a, BaseException))
    # The replicas' EngineStats (engine/async_engine.py, not imported: it would load the engine's modules
    # into the ingress) added field by field.
    first, *_ = by_replica.values()
    return replace(first, **{spec.name: _summed([getattr(s, spec.name) for s in by_replica.values()])
                             for spec in fields(first)})


def _summed(values: list):
    """One stats field over the replicas: counts added, dicts added key by key (zeros kept: a
    gauge set to 0), a string (the dtype) the first replica's."""
    if isinstance(values[0], str):
        return values[0]
    if isinstance(values[0], dict):
        merged = {}
        for value in values:
            for key, count in value.items():
                merged[key] = merged.get(key, 0) + count
        return merged
    return sum(values)


class IngressMetrics:
    """The metrics of METRICS, each an attribute by its ``attr``, in one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for m in METRICS:
            extra = {} if m.buckets is None else {"buckets": m.buckets}
            setattr(self, m.attr, m.kind(m.name, m.help, list(m.labels), registry=self.registry, **extra))

    def observe(self, trace: RequestTrace) -> None:
        """An engine request has ended: each phase it went through, once."""
        phases = trace.phases()
        for stage in ("ingress", "prefill", "decode"):
            if f"queue_{stage}" in phases:
                self.queue_time.labels(stage).observe(phases[f"queue_{stage}"])
        for m in METRICS:
            if m.phase in phases:
                getattr(self, m.attr).observe(phases[m.phase])
        if trace.kv is not None:
            self.kv_bytes_hist.observe(trace.kv.nbytes)
        if "decode" in phases:
            self.tpot.observe(phases["decode"] / (trace.output_tokens - 1))
        self.e2e.observe(time.time() - trace.arrival)
        self.migrations.inc(trace.migrations)

    async def render(self, backend) -> bytes:
        """Refresh the engine gauges from the backend's deployments (and a PD backend's decisions),
        then the text exposition."""
        handles = backend.handles
        names = list(handles)
        stats = await asyncio.gather(*(deployment_stats(handles[n], n) for n in names), return_exceptions=True)
        for name, s in zip(names, stats):
            if isinstance(s, BaseException):
                continue
            for priority, depth in s.waiting_by_priority.items():
                self.queue_depth.labels(name, str(priority)).set(depth)
            for m in METRICS:
                if m.stat is not None:
                    getattr(self, m.attr).labels(name).set(getattr(s, m.stat))
            self.kv_blocks.labels(name, "used").set(s.blocks_used)
            self.kv_blocks.labels(name, "cached").set(s.blocks_cached)
            self.kv_blocks.labels(name, "free").set(s.blocks_total - s.blocks_used - s.blocks_cached)
            for reason, count in s.finished_by_reason.items():
                self.finished.labels(name, reason).set(count)
            for event, count in s.kv_tier.items():
                self.kv_tier.labels(name, event).set(count)
        for (where, reason), count in getattr(backend, "decisions", {}).items():
            self.pd_decisions.labels(where, reason).set(count)
        if (watch := getattr(backend, "watch", None)) is not None:
            self.pd_decode_answering.set(len(watch.answering()))
            self.pd_prefill_answering.set(len(watch.prefill_answering()))
            fetches = watch.transfers()
            self.kv_in_flight.set(fetches["in_flight"])
            self.kv_oldest.set(fetches["oldest_s"])
            self.kv_past_deadline.set(fetches["past_deadline"])
            for cause, count in fetches["failed"].items():
                self.kv_failed.labels(cause).set(count)
        for event, count in getattr(backend, "moves", {}).items():
            self.kv_moves.labels(event).set(count)
        for source, count in getattr(backend, "prompt_tokens", {}).items():
            self.pd_prompt_tokens.labels(source).set(count)
        for name, count in (await running_replicas()).items():
            self.replicas.labels(name).set(count)
        if "DecodeServer" in handles:
            try:
                transfers = await asyncio.wait_for(handles["DecodeServer"].kv_transfers.remote(), STATS_TIMEOUT_S)
            except Exception:  # a stalled (TimeoutError) or failed D: the last values stay
                transfers = None
            if transfers is not None:
                self.kv_bytes.set(transfers["bytes"])
                self.kv_transfers.set(transfers["count"])
        if "PrefillServer" in handles:
            await self._prefix_store(handles["PrefillServer"])
        return generate_latest(self.registry)

    async def _prefix_store(self, prefill) -> None:
        """The prefix store's counters, through any P replica (the store is the app's one)."""
        try:
            counters = await asyncio.wait_for(prefill.prefix_store_counters.remote(), STATS_TIMEOUT_S)
        except Exception:  # a stalled or failed P, or the store: the last values stay
            return
        if counters is None:
            return
        for event in ("published", "hit_blocks", "pulled_blocks", "evictions", "blocks"):
            self.prefix_store_blocks.labels(event).set(counters[event])
        for event in ("lookups", "hits", "pulls"):
            self.prefix_store_calls.labels(event).set(counters[event])
        self.prefix_store_bytes.labels("held").set(counters["bytes"])
        self.prefix_store_bytes.labels("kept_for_pulls").set(counters["kept_for_pulls"])


async def running_replicas() -> dict[str, int]:
    """Running replicas per deployment of the calling replica's application; {} if Serve's status
    does not come in time."""
    try:
        deployments = await app_deployments(STATUS_TIMEOUT_S)
    except Exception:
        return {}
    return {name: info.replica_states.get("RUNNING", 0) for name, info in deployments.items()}
