"""Write a small Mooncake-format trace (JSONL) of chat sessions, for pdserve-loadtest --trace and aiperf.

    python tools/make_trace.py --mode multi-turn --out multi_turn.jsonl
    python tools/make_trace.py --mode no-reuse --out no_reuse.jsonl

multi-turn: ``--sessions`` conversations of ``--turns`` turns, all opening with the same system prompt
(``--system-tokens``); each turn's prompt is the previous turn's prompt, its answer (the previous
turn's ``output_length`` tokens) and a new user message (``--user-tokens``, LOW:HIGH uniform). Session
s starts at s x ``--session-gap-ms``, its turns ``--think-ms`` apart. no-reuse: the same requests at the
same times, every block a block of its own (a workload no prefix cache helps).

Hash ids are made as a prefix cache keys blocks: a block's id names its tokens and every token before
it, so the partial last block of a turn and the full block it grows into in the next turn differ.
Prints the trace's block reuse (blocks an earlier request had, over all blocks) to stderr.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import random
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.loadgen import parse_length  # noqa: E402
from tools.trace import MOONCAKE_BLOCK_SIZE, TraceRecord, block_reuse  # noqa: E402


class BlockIds:
    """Hash ids by content: the id of a block is the same number wherever the same tokens are
    preceded by the same tokens (chained over the blocks before it), a new number otherwise."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[tuple, int] = {}

    def of(self, tokens: list) -> tuple[int, ...]:
        ids, parent = [], None
        for start in range(0, len(tokens), self.block_size):
            key = (parent, tuple(tokens[start:start + self.block_size]))
            parent = self._ids.setdefault(key, len(self._ids))
            ids.append(parent)
        return tuple(ids)


def multi_turn(sessions: int, turns: int, system_tokens: int, user_tokens: tuple[int, int], output_tokens: int,
               session_gap_ms: float, think_ms: float, block_size: int, seed: int) -> list[TraceRecord]:
    """Chat sessions sharing a system prompt, each turn extending the last (see the module docstring).
    A token is named by where it comes from (system, or session/turn/user-or-answer/position): equal
    names, equal tokens."""
    rng = random.Random(seed)
    ids = BlockIds(block_size)
    system = [("system", i) for i in range(system_tokens)]
    records = []
    for s in range(sessions):
        context = list(system)
        for t in range(turns):
            context += [(s, t, "user", i) for i in range(rng.randint(*user_tokens))]
            records.append(TraceRecord(s * session_gap_ms + t * think_ms, len(context), output_tokens,
                                       ids.of(context)))
            context += [(s, t, "answer", i) for i in range(output_tokens)]
    return sorted(records, key=lambda r: r.timestamp_ms)


def without_reuse(records: list[TraceRecord], block_size: int) -> list[TraceRecord]:
    """The same requests at the same times, each prompt's tokens its own (no block shared)."""
    ids = BlockIds(block_size)
    return [TraceRecord(r.timestamp_ms, r.input_length, r.output_length,
                        ids.of([(n, i) for i in range(r.input_length)])) for n, r in enumerate(records)]


def to_jsonl(records: list[TraceRecord]) -> str:
    return "".join(json.dumps({"timestamp": int(r.timestamp_ms), "input_length": r.input_length,
                               "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                   for r in records)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("multi-turn", "no-reuse"), default="multi-turn")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=3072)
    p.add_argument("--user-tokens", default="32:64", help="N or LOW:HIGH (uniform) per user message")
    p.add_argument("--output-tokens", type=int, default=16, help="each answer's length (output_length)")
    p.add_argument("--session-gap-ms", type=float, default=1000.0, help="between the starts of two sessions")
    p.add_argument("--think-ms", type=float, default=4000.0, help="between two turns of a session")
    p.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_SIZE, help="tokens per hash id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for name in ("sessions", "turns", "output_tokens", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if args.system_tokens < 0 or args.session_gap_ms < 0 or args.think_ms < 0:
        p.error("--system-tokens, --session-gap-ms and --think-ms must be >= 0")
    try:
        args.user_tokens = parse_length(args.user_tokens)
    except ValueError as error:
        p.error(f"--user-tokens: {error}")
    return args


def main(argv: list[str] | None = None) -> list[TraceRecord]:
    args = parse_args(argv)
    records = multi_turn(args.sessions, args.turns, args.system_tokens, args.user_tokens, args.output_tokens,
                         args.session_gap_ms, args.think_ms, args.block_size, args.seed)
    if args.mode == "no-reuse":
        records = without_reuse(records, args.block_size)
    args.out.write_text(to_jsonl(records))
    reuse = block_reuse(records)
    print(f"{args.out}: {len(records)} requests, {reuse['blocks']} blocks of {args.block_size} tokens, "
          f"block reuse {reuse['block_reuse']:.1%}, longest prompt {max(r.input_length for r in records)} tokens",
          file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
