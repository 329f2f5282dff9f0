"""The ingress's Prometheus metrics (GET /metrics).

Requests by endpoint, status and priority; time to first token and time per output token
as the ingress sees them; and, read from the engine deployments at scrape time, queue depth
by priority, KV blocks used / cached / free and the usage fraction, prefix-cache queries and
hits (tokens, as vLLM counts them), requests ended by finish reason, and KV bytes moved
from P to D. Deployment figures come from the replica a handle call reaches (one per
deployment per scrape).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "HTTP requests", ["endpoint", "status", "priority"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "arrival at the ingress to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "mean time per token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("pdserve_queue_depth", "requests waiting in an engine", ["deployment", "priority"],
                                 registry=r)
        self.running = Gauge("pdserve_running_requests", "requests running in an engine", ["deployment"], registry=r)
        self.kv_blocks = Gauge("pdserve_kv_blocks", "KV cache blocks", ["deployment", "state"], registry=r)
        self.finished = Gauge("pdserve_engine_requests_finished", "requests an engine has ended since it started",
                              ["deployment", "reason"], registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage_perc", "fraction of KV blocks held by requests (cached "
                              "blocks count as free)", ["deployment"], registry=r)
        self.prefix_queries = Gauge("pdserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                    ["deployment"], registry=r)
        self.prefix_hits = Gauge("pdserve_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                 ["deployment"], registry=r)
        self.prompt_computed = Gauge("pdserve_prompt_tokens_computed", "prompt tokens run through the model "
                                     "(not prefix hits, not imported KV)", ["deployment"], registry=r)
        self.kv_bytes = Gauge("pdserve_kv_bytes_moved", "KV bytes moved from P to D", registry=r)
        self.kv_transfers = Gauge("pdserve_kv_transfers", "KV transfers from P to D", registry=r)

    async def timed(self, stream: AsyncIterator[RequestOutput], arrival: float) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, recording its TTFT and TPOT."""
        first = None
        count = 0
        try:
            async for output in stream:
                count += len(output.new_token_ids)
                if first is None and output.new_token_ids:
                    first = time.time()
                    self.ttft.observe(first - arrival)
                if output.finished and first is not None and count > 1:
                    self.tpot.observe((time.time() - first) / (count - 1))
                yield output
        finally:
            await stream.aclose()

    async def render(self, handles: dict) -> bytes:
        """Refresh the engine gauges from the deployments, then the text exposition."""
        names = list(handles)
        stats = await asyncio.gather(*(handles[n].stats.remote() for n in names), return_exceptions=True)
        for name, s in zip(names, stats):
            if isinstance(s, BaseException):
                continue
            for priority, depth in s.waiting_by_priority.items():
                self.queue_depth.labels(name, str(priority)).set(depth)
            self.running.labels(name).set(s.running)
            self.kv_blocks.labels(name, "used").set(s.blocks_used)
            self.kv_blocks.labels(name, "cached").set(s.blocks_cached)
            self.kv_blocks.labels(name, "free").set(s.blocks_total - s.blocks_used - s.blocks_cached)
            self.kv_usage.labels(name).set(s.kv_cache_usage)
            self.prefix_queries.labels(name).set(s.prefix_cache_queries)
            self.prefix_hits.labels(name).set(s.prefix_cache_hits)
            self.prompt_computed.labels(name).set(s.prompt_tokens_computed)
            for reason, count in s.finished_by_reason.items():
                self.finished.labels(name, reason).set(count)
        if "DecodeServer" in handles:
            transfers = await handles["DecodeServer"].kv_transfers.remote()
            self.kv_bytes.set(transfers["bytes"])
            self.kv_transfers.set(transfers["count"])
        return generate_latest(self.registry)
