"""The prefix-cache hit rate the engines saw over a run, from the server's /metrics read before and after.

The ingress exports each engine deployment's prompt tokens looked up in its prefix cache and found
there (``pdserve_prefix_cache_queries`` / ``pdserve_prefix_cache_hits{deployment}``, tokens, as vLLM
counts them; deployments/ingress/metrics.py), running totals since the engine started. A run's figures are
the differences. The ingress sums each deployment's replicas (every replica it routes to, each
counted once: deployments/ingress/metrics.py's ``deployment_stats``).
"""

from __future__ import annotations

import re

import httpx

PREFIX_CACHE = re.compile(r'^pdserve_prefix_cache_(queries|hits)\{deployment="(\w+)"\} (\S+)$', re.MULTILINE)


def prefix_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """{deployment: {"queries": tokens, "hits": tokens}} from a /metrics exposition."""
    counters: dict[str, dict[str, float]] = {}
    for kind, deployment, value in PREFIX_CACHE.findall(metrics_text):
        counters.setdefault(deployment, {"queries": 0.0, "hits": 0.0})[kind] = float(value)
    return counters


async def read_prefix_counters(client: httpx.AsyncClient) -> dict[str, dict[str, float]] | None:
    """The server's prefix counters now; None when /metrics does not answer."""
    try:
        response = await client.get("/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return prefix_counters(response.text) if response.status_code == 200 else None


def prefix_hit_report(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """The run's prefix-cache figures: per deployment the tokens looked up, found, and their ratio;
    and ``prefix_hit_rate``, all deployments' hits over all their queries (in PD, P's and D's)."""
    per_deployment = {}
    for deployment, now in after.items():
        then = before.get(deployment, {"queries": 0.0, "hits": 0.0})
        queries, hits = now["queries"] - then["queries"], now["hits"] - then["hits"]
        per_deployment[deployment] = {"queries": int(queries), "hits": int(hits),
                                      "hit_rate": hits / queries if queries else 0.0}
    queries = sum(d["queries"] for d in per_deployment.values())
    hits = sum(d["hits"] for d in per_deployment.values())
    return {"prefix_hit_rate": hits / queries if queries else 0.0, "per_deployment": per_deployment}
