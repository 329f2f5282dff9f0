"""A running request moved off a draining D with its KV, against token replay: the time from the
move to the request's next token on the new engine, by context length (in process, two engines).

Move: ``move_out`` on the source (the KV copied out), the ``Moved`` pickled and unpickled (the
channel's copy), the resumed request added to the target in DECODE mode with that KV, steps until
its next token. Replay: the resumed request token replay sends (prompt and tokens so far
recomputed), added to the target, steps until its next token. Prefix caching off, so replay
computes every token, as on a replica that does not hold the prompt. Medians of ``--repeats``.

    python benchmarks/kv_move.py [--model PATH] [--contexts 512 2048] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
import pickle
import statistics
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from deployments.ingress.migration import moved_leg  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest, Mode  # noqa: E402
from sampling import SamplingParams  # noqa: E402

DECODED = 8  # tokens the request has made before it moves
PARAMS = SamplingParams(max_new_tokens=64, min_new_tokens=64, temperature=0.0)


def until_next_token(llm: LLMEngine, request_id: str) -> None:
    while not any(o.request_id == request_id and o.new_token_ids for o in llm.step()):
        pass


def one(source: LLMEngine, target: LLMEngine, context: int, round_: int) -> dict:
    prompt = [(7 * i + context + 131 * round_) % 800 + 3 for i in range(context)]
    request = GenerationRequest(f"r{context}-{round_}", prompt, PARAMS)
    source.add_request(request)
    for _ in range(DECODED):
        source.step()
    start = time.perf_counter()
    moved = pickle.loads(pickle.dumps(source.move_out(request.request_id)))
    leg, handoff = moved_leg(request, moved.choices[0], 1)
    target.add_request(leg, Mode.DECODE, handoff)
    until_next_token(target, leg.request_id)
    move_s = time.perf_counter() - start
    target.abort(leg.request_id)
    replayed = replace(leg, request_id=f"{leg.request_id}.replay", resumed_output_ids=moved.choices[0].output_ids)
    start = time.perf_counter()
    target.add_request(replayed)
    until_next_token(target, replayed.request_id)
    replay_s = time.perf_counter() - start
    target.abort(replayed.request_id)
    return {"context": context, "kv_mb": moved.nbytes / 1e6, "move_ms": move_s * 1e3, "replay_ms": replay_s * 1e3}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, enable_prefix_caching=False, torch_threads=1,
                          max_num_batched_tokens=max(args.contexts) + DECODED + 1)
    source, target = LLMEngine(config), LLMEngine(config)
    rows = []
    for context in args.contexts:
        runs = [one(source, target, context, r) for r in range(args.repeats)]
        row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        row["replay_over_move"] = row["replay_ms"] / row["move_ms"]
        rows.append(row)
        print(f"context {context:5d}: KV {row['kv_mb']:.1f} MB, move {row['move_ms']:.1f} ms, "
              f"replay {row['replay_ms']:.1f} ms, replay/move {row['replay_over_move']:.1f}x", flush=True)
    write_json(args.json, {"arguments": arguments(args), "rows": rows})


if __name__ == "__main__":
    main()
