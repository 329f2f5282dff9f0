"""Aggregating load-test results with vLLM's metric definitions and JSON field names."""

from __future__ import annotations

from collections import Counter

import numpy as np

from tools.clients import Result

PERCENTILES = (50, 90, 99)


def _describe(name: str, values_s: list[float]) -> dict:
    """mean/median/std/p90/p99 of ``values_s`` (seconds) in milliseconds, as vLLM names them."""
    values = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
           f"std_{name}_ms": float(values.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(values, p))
    return out


def summarize(results: list[Result], duration_s: float, goodput: dict[str, float] | None = None) -> dict:
    """vLLM's fields: completed, failed, request_throughput, output_throughput, mean/median/p90/p99 of
    ttft, tpot, itl, e2el (ms), request_goodput; plus errors by status."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.input_tokens for r in done)
    summary = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s else 0.0,
        "errors": dict(Counter(str(r.status) for r in results if not r.ok)),
    }
    summary |= _describe("ttft", [r.ttft for r in done])
    summary |= _describe("tpot", [r.tpot for r in done if r.tpot is not None])
    summary |= _describe("itl", [gap for r in done for gap in r.itl])
    summary |= _describe("e2el", [r.e2el for r in done])
    if goodput:
        good = [r for r in done if _meets(r, goodput)]
        summary["request_goodput"] = len(good) / duration_s if duration_s else 0.0
        summary["goodput_slo_ms"] = goodput
    return summary


def _meets(result: Result, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(measured[k] * 1000.0 <= v for k, v in slo_ms.items())


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slo = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        slo[name] = float(value)
    return slo


def per_priority(results: list[Result], duration_s: float, goodput: dict[str, float] | None) -> dict:
    priorities = sorted({r.work.priority for r in results})
    return {str(p): summarize([r for r in results if r.work.priority == p], duration_s, goodput) for p in priorities}
