"""Mooncake / FAST'25 request traces: reading one, the prompts its hash ids stand for, and when to send each.

A trace is JSONL, one request a line: ``timestamp`` (ms since the trace began), ``input_length`` and
``output_length`` (tokens), and ``hash_ids``, one id per block of ``block_size`` prompt tokens (512 in
the published traces; the last block may be partial). Equal ids are equal blocks *and* equal prefixes
up to them, the way a prefix cache keys its blocks; so a replay builds each block's tokens from its id
alone, and two requests share exactly the prompt blocks whose ids they share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
import json
import math
from pathlib import Path
import random

from tools.loadgen import WORDS, Work

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake (FAST'25) traces


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[TraceRecord]:
    """The records of a trace file, in timestamp order (stable for equal stamps). A record that is not
    of the format, or whose hash ids do not cover its input at ``block_size`` tokens each, is refused
    (ValueError naming its line): a wrong block size would silently build prompts of another shape."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            records.append(_record(json.loads(line), block_size, f"{path}:{number}"))
    if not records:
        raise ValueError(f"{path}: no records")
    return sorted(records, key=lambda r: r.timestamp_ms)


def _record(raw: dict, block_size: int, where: str) -> TraceRecord:
    missing = {"timestamp", "input_length", "output_length", "hash_ids"} - set(raw)
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)} (the Mooncake trace format)")
    record = TraceRecord(float(raw["timestamp"]), int(raw["input_length"]), int(raw["output_length"]),
                         tuple(int(h) for h in raw["hash_ids"]))
    if record.timestamp_ms < 0 or record.input_length < 1 or record.output_length < 1:
        raise ValueError(f"{where}: timestamp must be >= 0, input_length and output_length >= 1")
    blocks = math.ceil(record.input_length / block_size)
    if len(record.hash_ids) != blocks:
        raise ValueError(f"{where}: {len(record.hash_ids)} hash_ids for input_length {record.input_length}; "
                         f"blocks of {block_size} tokens need {blocks} (is --block-size the trace's?)")
    return record


# Blocks are drawn from a random generator seeded by "<seed>:<hash id>" (a string seed is hashed the
# same in every process): the same trace and seed give the same prompts anywhere, another seed none
# of them (a replay that shares no block with an earlier one, on a server whose cache is warm).


@lru_cache(maxsize=1 << 16)
def block_token_ids(hash_id: int, block_size: int, token_range: tuple[int, int], seed: int = 0) -> tuple[int, ...]:
    """The ``block_size`` token ids that ``hash_id`` stands for: random in ``token_range``."""
    rng = random.Random(f"{seed}:{hash_id}")
    return tuple(rng.randrange(*token_range) for _ in range(block_size))


@lru_cache(maxsize=1 << 16)
def block_text(hash_id: int, block_size: int, seed: int = 0) -> str:
    """``block_size`` words that ``hash_id`` stands for, each after a space: byte-level BPE tokenizers
    split before a space, so a block tokenizes the same whatever comes before it, and prompts that share
    blocks share their tokens. A word may be more than one token: the token count is approximate."""
    rng = random.Random(f"{seed}:{hash_id}")
    return "".join(" " + rng.choice(WORDS) for _ in range(block_size))


def prompt_token_ids(record: TraceRecord, block_size: int, token_range: tuple[int, int], seed: int = 0
                     ) -> list[int]:
    """The record's prompt for /infer_token: its blocks' token ids in order, the last block cut to
    ``input_length`` in all."""
    ids = [t for h in record.hash_ids for t in block_token_ids(h, block_size, token_range, seed)]
    return ids[:record.input_length]


def prompt_text(record: TraceRecord, block_size: int, seed: int = 0) -> str:
    """The record's prompt for the /v1 routes: its blocks' words in order, ``input_length`` words in all."""
    last = record.input_length - (len(record.hash_ids) - 1) * block_size
    blocks = [block_text(h, block_size, seed) for h in record.hash_ids]
    cut = blocks[-1].split(" ")[1:last + 1]  # the words of the partial last block
    return "".join(blocks[:-1]) + "".join(" " + word for word in cut)


def send_offsets(records: list[TraceRecord], speedup: float) -> list[float]:
    """Seconds from the first record's send to each record's: the trace's gaps divided by ``speedup``."""
    first = records[0].timestamp_ms
    return [(r.timestamp_ms - first) / 1000.0 / speedup for r in records]


def block_reuse(records: list[TraceRecord]) -> dict:
    """How much of the trace's prompts an ideal prefix cache (one for all, never evicting) holds:
    blocks whose id an earlier request already had, over all blocks. An upper bound on a replay's
    block hit rate; a hit rate in tokens comes close to it when blocks are long next to partial ones."""
    seen: set[int] = set()
    reused = total = 0
    for record in records:
        reused += sum(h in seen for h in record.hash_ids)
        total += len(record.hash_ids)
        seen.update(record.hash_ids)
    return {"blocks": total, "reused_blocks": reused, "block_reuse": reused / total if total else 0.0}


def trace_rate(records: list[TraceRecord], speedup: float) -> float:
    """Requests per second the replay offers: the records over their span (inf when all share one stamp)."""
    span_s = send_offsets(records, speedup)[-1]
    return len(records) / span_s if span_s > 0 else float("inf")


def trace_workloads(records: list[TraceRecord], block_size: int, token_range: tuple[int, int],
                    priorities: list[int], seed: int = 0) -> list[Work]:
    """One Work per record, its prompt built from its hash ids (token ids and text), its output length
    the record's, its priority ``priorities[i]``."""
    return [Work(i, prompt_token_ids(r, block_size, token_range, seed), prompt_text(r, block_size, seed),
                 r.output_length, priorities[i]) for i, r in enumerate(records)]
