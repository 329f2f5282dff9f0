"""Workloads and arrivals for the load tester: what to send, and when."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
import json
from pathlib import Path
import random
from typing import Iterator

WORDS = ("the model serves tokens while prefill and decode share nothing but the cache of keys and values "
         "priority one overtakes priority five when the queue is long enough to matter").split()


@dataclass
class Work:
    index: int
    input_ids: list[int]  # for /infer_token
    prompt: str  # for /v1 endpoints
    output_len: int
    priority: int
    warmup: bool = False


def parse_length(spec: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> uniform in [64, 256]."""
    low, _, high = spec.partition(":")
    low_n, high_n = int(low), int(high or low)
    if not 0 < low_n <= high_n:
        raise ValueError(f"length {spec!r}: expected N or LOW:HIGH with 0 < LOW <= HIGH")
    return low_n, high_n


def parse_priority_mix(spec: str | None) -> list[tuple[int, float]]:
    """'1:0.2,5:0.8' -> [(1, 0.2), (5, 0.8)] (weights normalised)."""
    if not spec:
        return [(5, 1.0)]
    pairs = []
    for item in spec.split(","):
        priority, _, weight = item.partition(":")
        if not 1 <= int(priority) <= 5 or float(weight) <= 0:
            raise ValueError(f"priority mix {item!r}: expected PRIORITY:WEIGHT with priority 1..5, weight > 0")
        pairs.append((int(priority), float(weight)))
    total = sum(w for _, w in pairs)
    return [(p, w / total) for p, w in pairs]


def draw_priority(rng: random.Random, mix: list[tuple[int, float]]) -> int:
    """One request's priority, drawn from a parsed ``mix``."""
    return rng.choices([p for p, _ in mix], [w for _, w in mix])[0]


def workloads(num: int, input_len: str, output_len: str, seed: int, priority_mix: str | None,
              token_range: tuple[int, int], dataset: Path | None = None, warmup: int = 0) -> list[Work]:
    """``warmup`` + ``num`` requests: random token ids (and as many words) of the asked lengths,
    or the records of a JSONL dataset ({"prompt": str | "input_ids": [...], "output_len": int})."""
    rng = random.Random(seed)
    mix = parse_priority_mix(priority_mix)
    records = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()] if dataset else None
    in_low, in_high = parse_length(input_len)
    out_low, out_high = parse_length(output_len)
    work = []
    for i in range(warmup + num):
        priority = draw_priority(rng, mix)
        if records:
            record = records[i % len(records)]
            ids = record.get("input_ids") or [rng.randrange(*token_range) for _ in range(len(record["prompt"].split()))]
            prompt = record.get("prompt") or " ".join(rng.choice(WORDS) for _ in ids)
            out = int(record["output_len"])
        else:
            n = rng.randint(in_low, in_high)
            ids = [rng.randrange(*token_range) for _ in range(n)]
            prompt = " ".join(rng.choice(WORDS) for _ in range(n))
            out = rng.randint(out_low, out_high)
        work.append(Work(i, ids, prompt, out, priority, warmup=i < warmup))
    return work


def arrival_gaps(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds between arrivals: gamma(shape=burstiness, mean 1/rate); burstiness 1 is Poisson.
    An infinite rate sends everything at once."""
    rng = random.Random(seed + 1)
    while True:
        yield 0.0 if rate == float("inf") else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_offsets(rate: float, burstiness: float, seed: int, count: int) -> list[float]:
    """Seconds from the first of ``count`` arrivals to each, with ``arrival_gaps`` between them."""
    gaps = arrival_gaps(rate, burstiness, seed)
    return list(accumulate((next(gaps) for _ in range(count - 1)), initial=0.0))
