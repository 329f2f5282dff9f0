"""Priority as an order of service (issue 41): TTFT by priority with the engine's prefill saturated.

The load tester's priority mix (tools/loadgen.py ``workloads``: 512-token prompts, priority 1
for 20 % of the requests, 5 for the rest) in a closed loop of --concurrency clients, driven against
one in-process engine (``LLMEngine``, the scheduler P, D and colocated share; in process because
a served app is too heavy for a shared 2-core box, and the ingress adds no ordering of its own).
Then the same engine idle: priority-1 prompts of the run alone (before the run and after it), their TTFT. Reports p50/p99 TTFT
of priority 1 and 5, and priority 1's p99 against priority 5's and against the idle TTFT's median.
Targets (issue 41): p99(1) <= 0.25 x p99(5) and <= 2 x idle.

    python benchmarks/priority_service.py [--concurrency 64] [--num-requests 264] [--input-len 512]
        [--output-len 16] [--max-num-batched-tokens 512] [--layers 4] [--json PATH]

The model is a random one shaped like SmolLM-135M (``--layers`` of its 30), float32 on the CPU.
"""

from __future__ import annotations

from pathlib import Path
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import SMOLLM_8L, make_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from tools.loadgen import workloads  # noqa: E402

WARMUP_REQUESTS = 3  # prompts run alone before the measurement (first-call costs)
IDLE_PROMPTS = 5  # priority-1 prompts of the run timed alone, before it and again after it


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request(work, output_len: int) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    return GenerationRequest(f"r{work.index}", work.input_ids, params, priority=work.priority)


def saturated(engine: LLMEngine, work: list, concurrency: int, output_len: int) -> dict[str, tuple[int, float]]:
    """The closed loop: ``concurrency`` requests in the engine at all times until ``work`` is sent;
    request id -> (priority, TTFT in s), TTFT from add_request to the step that made its first token.
    The first ``concurrency`` requests, sent at once, are the load tester's warm-up: not measured."""
    pending, arrival, ttft, in_flight = list(work), {}, {}, set()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            w = pending.pop(0)
            engine.add_request(request(w, output_len))
            arrival[f"r{w.index}"] = (w.priority, time.perf_counter())
            in_flight.add(f"r{w.index}")
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            priority, sent = arrival[output.request_id]
            if output.num_output_tokens and output.request_id not in ttft:
                ttft[output.request_id] = (priority, now - sent)
            if output.finished:
                in_flight.discard(output.request_id)
    return {rid: t for rid, t in ttft.items() if int(rid[1:]) >= concurrency}


def idle_ttft(engine: LLMEngine, work: list, output_len: int) -> list[float]:
    """Each prompt alone on the idle engine (prefix cache off: nothing of it is cached)."""
    times = []
    for w in work:
        start = time.perf_counter()
        engine.add_request(request(w, output_len))
        while True:
            outputs = engine.step()
            if any(o.num_output_tokens for o in outputs):
                times.append(time.perf_counter() - start)
                break
        while engine.has_work():
            engine.step()
    return times


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=264)  # 200 measured after 64 of warm-up
    parser.add_argument("--input-len", default="512")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--priority-mix", default="1:0.2,5:0.8")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", num_hidden_layers=args.layers)
        config = EngineConfig(model=str(model), dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens,
                              enable_prefix_caching=False, kv_cache_memory_gb=1.0)
        engine = LLMEngine(config)
        work = workloads(args.num_requests, args.input_len, str(args.output_len), args.seed, args.priority_mix,
                         (3, SMOLLM_8L["vocab_size"]))
        idle_ttft(engine, workloads(WARMUP_REQUESTS, args.input_len, "1", args.seed + 1, None,
                                    (3, SMOLLM_8L["vocab_size"])), 1)
        first_ones = [w for w in work if w.priority == 1][:2 * IDLE_PROMPTS]
        idle = idle_ttft(engine, first_ones[:IDLE_PROMPTS], 1)  # before and after: the machine's load drifts
        start = time.perf_counter()
        ttft = saturated(engine, work, args.concurrency, args.output_len)
        duration = time.perf_counter() - start
        idle += idle_ttft(engine, first_ones[IDLE_PROMPTS:], 1)

    by_priority = {p: [t for q, t in ttft.values() if q == p] for p in sorted({q for q, _ in ttft.values()})}
    result = {"args": arguments(args),
              "duration_s": duration, "preemptions": engine.scheduler.num_preemptions,
              "idle_ttft_ms": {"p50": 1000 * statistics.median(idle), "max": 1000 * max(idle)},
              "ttft_ms": {p: {"n": len(ts), "p50": 1000 * statistics.median(ts), "p90": 1000 * percentile(ts, 0.9),
                              "p99": 1000 * percentile(ts, 0.99)}
                          for p, ts in by_priority.items()}}
    p1, p5 = result["ttft_ms"][1]["p99"], result["ttft_ms"][5]["p99"]
    result["p99_ratio_1_to_5"] = p1 / p5
    result["p99_1_to_idle"] = p1 / result["idle_ttft_ms"]["p50"]
    print(f"{'priority':<10}{'n':>6}{'p50 TTFT ms':>14}{'p90 TTFT ms':>14}{'p99 TTFT ms':>14}")
    for p, r in result["ttft_ms"].items():
        print(f"{p:<10}{r['n']:>6}{r['p50']:>14.0f}{r['p90']:>14.0f}{r['p99']:>14.0f}")
    print(f"idle TTFT ms: p50 {result['idle_ttft_ms']['p50']:.0f}, max {result['idle_ttft_ms']['max']:.0f}; "
          f"{duration:.0f} s, {result['preemptions']} preemptions")
    print(f"p99 TTFT priority 1 / priority 5 = {result['p99_ratio_1_to_5']:.3f} (target <= 0.25); "
          f"priority 1 p99 / idle p50 = {result['p99_1_to_idle']:.2f} (target <= 2)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
