"""Rate-matched P:D on a trace: the replicas the planner (deployments/pd/pd_planner.py) would choose.

    python benchmarks/pd_planner.py --profile            # measure this machine's costs first
    python benchmarks/pd_planner.py --plot pd_planner.png --json pd_planner.json

A bursty trace of request arrivals, each with its prompt and output length, is generated from a
seed (the same seed, the same trace): the arrival rate moves between quiet, busy and burst phases
(a Markov-modulated Poisson process), and the mix moves between chat (64-512 tokens in, 32-256
out), long prompts (2-4k in, 32-128 out) and long answers (128-512 in, 512-1024 out), so the load
P and D see does not rise and fall together. Replayed in intervals of ``--interval-s``, as Ray
Serve calls an autoscaling policy: at each interval the planner gets what the replicas would have
measured over the last one (prompt tokens computed, prompts, output tokens per second; P's
queued prompt tokens, D's requests), exactly the figures ``PrefillRateScaling`` and
``DecodeRateScaling`` read, and chooses P and D for the next. A fluid model carries what the chosen
replicas could not serve into the next interval (P's queue; D's waiting sequences).

Printed: the replicas chosen over time, the share of intervals where the chosen capacity covered
the interval's load at the SLO targets, and the replica-seconds against the smallest fixed split
that covers the same share of intervals (and every interval). ``--profile`` measures the costs
the planner needs on this machine, as Dynamo's planner reads them from a profiling run:
tiny-llama, one torch thread, float32, a prompt token's prefill time and the decode step's time
against its batch.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
import json
import math
from pathlib import Path
import time

import numpy as np

from benchmarks.cli import bench_parser, write_json
from deployments.pd.pd_planner import DecodeProfile, decode_batch, decode_capacity, decode_replicas, prefill_capacity, \
    prefill_replicas

PHASES = {"quiet": 3.0, "busy": 12.0, "burst": 30.0}  # requests per second
PHASE_MEAN_S = {"quiet": 240.0, "busy": 180.0, "burst": 45.0}
NEXT_PHASE = {"quiet": ("busy", "burst"), "busy": ("quiet", "burst"), "burst": ("busy", "quiet")}
MIXES = ({"chat": 0.8, "long_prompt": 0.1, "long_answer": 0.1},  # the share of each kind, drawn per phase
         {"chat": 0.3, "long_prompt": 0.6, "long_answer": 0.1},
         {"chat": 0.3, "long_prompt": 0.1, "long_answer": 0.6})
LENGTHS = {"chat": ((64, 512), (32, 256)), "long_prompt": ((2000, 4000), (32, 128)),
           "long_answer": ((128, 512), (512, 1024))}  # (prompt, output) token ranges, uniform


@dataclass
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def trace(seed: int, duration_s: float) -> list[Request]:
    """The bursty trace (module docstring), sorted by arrival."""
    rng = np.random.default_rng(seed)
    requests, now, phase = [], 0.0, "quiet"
    while now < duration_s:
        end = min(duration_s, now + rng.exponential(PHASE_MEAN_S[phase]))
        mix = MIXES[rng.integers(len(MIXES))]
        kinds, shares = list(mix), list(mix.values())
        while (now := now + rng.exponential(1 / PHASES[phase])) < end:
            (p_lo, p_hi), (o_lo, o_hi) = LENGTHS[kinds[rng.choice(len(kinds), p=shares)]]
            requests.append(Request(now, int(rng.integers(p_lo, p_hi + 1)), int(rng.integers(o_lo, o_hi + 1))))
        now, phase = end, NEXT_PHASE[phase][rng.integers(2)]
    return requests


@dataclass
class Interval:
    start_s: float
    requests_per_s: float
    prompt_tokens_per_s: float  # arriving
    output_tokens_per_s: float
    p_replicas: int  # chosen at its start, from the interval before
    d_replicas: int
    p_needed: int  # what this interval's own load needs (an oracle: the planner cannot know it)
    d_needed: int


def replay(requests: list[Request], args: argparse.Namespace) -> list[Interval]:
    profile = DecodeProfile(args.decode_step_ms, args.decode_ms_per_sequence)
    n = math.ceil(args.duration_s / args.interval_s)
    arrivals = np.array([r.arrival_s for r in requests])
    bins = np.minimum((arrivals // args.interval_s).astype(int), n - 1)
    count = np.bincount(bins, minlength=n)
    prompt = np.bincount(bins, weights=[r.prompt_tokens for r in requests], minlength=n)
    output = np.bincount(bins, weights=[r.output_tokens for r in requests], minlength=n)
    p, d = args.min_replicas, args.min_replicas
    p_queue = d_queue = d_waiting = 0.0  # prompt tokens P has not computed, output tokens D has not made, as sequences
    measured = None  # what the replicas measured over the last interval
    out = []
    for k in range(n):
        if measured is not None:  # the policies' call, with the figures the replicas reported
            p = _clamp(prefill_replicas(args.prefill_ms_per_token, args.slo_ttft_ms, *measured[:2], p_queue,
                                        args.interval_s), args)
            d = _clamp(decode_replicas(profile, args.slo_tpot_ms, measured[2], measured[3] + d_waiting), args)
        dt = args.interval_s
        prompt_rate, prompts_rate, output_rate = prompt[k] / dt, count[k] / dt, output[k] / dt
        isl = prompt[k] / count[k] if count[k] else 0.0
        osl = output[k] / count[k] if count[k] else 0.0
        p_needed = prefill_replicas(args.prefill_ms_per_token, args.slo_ttft_ms, prompt_rate, prompts_rate, 0,
                                    args.interval_s)
        d_needed = decode_replicas(profile, args.slo_tpot_ms, output_rate, 0)
        # The fluid model: P computes at most its raw rate, D serves at most its rate at the target.
        p_served = min(prompt[k] + p_queue, p * 1000 / args.prefill_ms_per_token * dt)
        p_queue = prompt[k] + p_queue - p_served
        d_capacity = d * decode_capacity(profile, args.slo_tpot_ms) * dt
        d_served = min(output[k] + d_queue, d_capacity)
        d_queue = output[k] + d_queue - d_served
        d_waiting = d_queue / osl if osl else 0.0
        running = d_served / dt * args.slo_tpot_ms / 1000  # sequences, by Little's law
        measured = (p_served / dt, (p_served / isl if isl else 0.0) / dt, d_served / dt, running)
        out.append(Interval(k * dt, prompts_rate, prompt_rate, output_rate, p, d, p_needed, d_needed))
    return out


def _clamp(replicas: int, args: argparse.Namespace) -> int:
    return max(args.min_replicas, min(args.max_replicas, replicas))


def summary(intervals: list[Interval], args: argparse.Namespace) -> dict:
    """Coverage (the share of intervals whose chosen replicas met their own load's need) and
    replica-seconds, for the planner and for fixed splits."""
    share = float(np.mean([i.p_replicas >= i.p_needed and i.d_replicas >= i.d_needed for i in intervals]))
    p_need, d_need = np.array([i.p_needed for i in intervals]), np.array([i.d_needed for i in intervals])

    def fixed(at_least: float) -> tuple[int, int] | None:
        """The fixed split with the fewest replicas that covers ``at_least`` of the intervals
        (None: none within --max-replicas does)."""
        splits = [(p + d, p, d) for p in range(args.min_replicas, args.max_replicas + 1)
                  for d in range(args.min_replicas, args.max_replicas + 1)
                  if np.mean((p >= p_need) & (d >= d_need)) >= at_least]
        return min(splits)[1:] if splits else None

    fixed_same, fixed_all = fixed(share), fixed(1.0)
    seconds = len(intervals) * args.interval_s
    return {
        "intervals": len(intervals), "covered_share": round(share, 3),
        "planner_replica_s": sum(i.p_replicas + i.d_replicas for i in intervals) * args.interval_s,
        "planner_mean_p": round(float(np.mean([i.p_replicas for i in intervals])), 2),
        "planner_mean_d": round(float(np.mean([i.d_replicas for i in intervals])), 2),
        "fixed_same_share": fixed_same, "fixed_same_share_replica_s": sum(fixed_same) * seconds if fixed_same else None,
        "fixed_every_interval": fixed_all,
        "fixed_every_interval_replica_s": sum(fixed_all) * seconds if fixed_all else None,
        "p_to_d_range": (round(min(i.p_replicas / i.d_replicas for i in intervals), 2),
                         round(max(i.p_replicas / i.d_replicas for i in intervals), 2)),
    }


def measure_profile() -> dict:
    """This machine's costs: a 1,024-token prompt's prefill per token, and the decode step at
    batches 1, 8, 32 and 64 (least squares: step = fixed + per sequence * batch). tiny-llama,
    one torch thread, float32."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import GenerationRequest
    from sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", torch_threads=1,
                                    enable_prefix_caching=False, max_num_batched_tokens=2048))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def prefill_ms(tokens: int, salt: int) -> float:
        engine.add_request(GenerationRequest(f"p{salt}", [(7 * i + salt) % 800 + 3 for i in range(tokens)],
                                             SamplingParams(max_new_tokens=1, ignore_eos=True)))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        return (time.perf_counter() - start) * 1000

    prefill_ms(1024, 0)  # warm
    per_token = min(prefill_ms(1024, s) for s in range(1, 4)) / 1024
    batches, steps = [1, 8, 32, 64], []
    for b in batches:
        for i in range(b):
            engine.add_request(GenerationRequest(f"d{b}-{i}", [(5 * i + j) % 800 + 3 for j in range(16)], params))
        engine.step()  # every prompt, then decodes only
        times = []
        for _ in range(20):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1000)
        steps.append(float(np.median(times)))
        while engine.has_work():
            engine.step()
    slope, fixed = np.polyfit(batches, steps, 1)
    return {"prefill_ms_per_token": round(per_token, 4), "decode_step_ms": round(max(0.0, fixed), 2),
            "decode_ms_per_sequence": round(slope, 3), "decode_step_ms_by_batch": dict(zip(batches, steps))}


def plot(path: Path, intervals: list[Interval], result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [i.start_s / 60 for i in intervals]
    fig, (load, replicas) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    load.plot(t, [i.prompt_tokens_per_s / 1000 for i in intervals], label="prompt ktok/s (P's load)")
    load.plot(t, [i.output_tokens_per_s / 100 for i in intervals], label="output 100 tok/s (D's load)")
    load.set_ylabel("offered load")
    load.legend(loc="upper right")
    replicas.step(t, [i.p_replicas for i in intervals], where="post", label="P (planner)")
    replicas.step(t, [i.d_replicas for i in intervals], where="post", label="D (planner)")
    if result["fixed_same_share"]:
        p_fixed, d_fixed = result["fixed_same_share"]
        replicas.axhline(p_fixed, color="C0", linestyle=":", label=f"fixed P = {p_fixed} (same coverage)")
        replicas.axhline(d_fixed, color="C1", linestyle=":", label=f"fixed D = {d_fixed} (same coverage)")
    replicas.set_ylabel("replicas")
    replicas.set_xlabel("minutes")
    replicas.legend(loc="upper right")
    fig.suptitle("Rate-matched P:D on a bursty trace")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--interval-s", type=float, default=10.0, help="the autoscaler's period and look-back")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.2)
    parser.add_argument("--decode-step-ms", type=float, default=8.0)
    parser.add_argument("--decode-ms-per-sequence", type=float, default=0.4)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="measure the costs on this machine and stop")
    parser.add_argument("--every", type=int, default=30, help="print one interval in this many")
    parser.add_argument("--plot", type=Path)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.profile:
        measured = measure_profile()
        print(json.dumps(measured, indent=1))
        return measured
    requests = trace(args.seed, args.duration_s)
    intervals = replay(requests, args)
    result = summary(intervals, args)
    profile = DecodeProfile(args.decode_step_ms, args.decode_ms_per_sequence)
    print(f"{len(requests)} requests over {args.duration_s:g} s (seed {args.seed}); SLO TTFT {args.slo_ttft_ms:g} ms, "
          f"TPOT {args.slo_tpot_ms:g} ms; D's batch at the target {decode_batch(profile, args.slo_tpot_ms)}, "
          f"{decode_capacity(profile, args.slo_tpot_ms):.0f} tok/s; P at a 1k prompt "
          f"{prefill_capacity(args.prefill_ms_per_token, 1000, args.slo_ttft_ms):.0f} tok/s")
    print("| minute | req/s | prompt tok/s | output tok/s | P | D | P needed | D needed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i in intervals[::args.every]:
        print(f"| {i.start_s / 60:.0f} | {i.requests_per_s:.1f} | {i.prompt_tokens_per_s:.0f} | "
              f"{i.output_tokens_per_s:.0f} | {i.p_replicas} | {i.d_replicas} | {i.p_needed} | {i.d_needed} |")
    print(json.dumps(result))
    if args.plot:
        plot(args.plot, intervals, result)
    write_json(args.json, {"summary": result, "intervals": [asdict(i) for i in intervals]})
    return result


if __name__ == "__main__":
    main()
