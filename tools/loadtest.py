"""Load-test a running pdserve server over HTTP (console script: pdserve-loadtest).

Open loop at --request-rate (Poisson; --burstiness for gamma arrivals) or closed loop at
--concurrency; bounded by --num-requests and --duration. Streams every request and reports
TTFT, TPOT, ITL and E2E latency (mean, median, p90, p99), throughput, goodput, errors by
status, all of it per priority too, with vLLM's JSON field names (`vllm bench serve`).

    pdserve-loadtest --endpoint infer_token --request-rate 4 --num-requests 100 \\
        --input-len 64:256 --output-len 32 --priority-mix 1:0.2,5:0.8 --json out.json --plot plots/

With --sample-replicas S it reads the server's /metrics every S seconds and reports the running
replicas of each deployment over the run, and the P:D ratio (PD under autoscaling).

With --sweep and --slo-grid it measures goodput as DistServe defines it: each rate's SLO attainment
for every (TTFT, TPOT) pair of the grid, and per pair the highest rate at which >= 90% attain:

    pdserve-loadtest --sweep 2,4,8,16 --slo-grid "ttft:1000,2000,4000 tpot:30,50,100" --json sweep.json

With --trace it replays a Mooncake/FAST'25 JSONL trace (tools/trace.py): each request at its
timestamp (divided by --speedup), its prompt built from its hash ids (blocks of --block-size tokens,
equal ids equal blocks), its output length the trace's; and it reports the prefix-cache hit rate the
engines saw (their /metrics before and after) beside the trace's own block reuse:

    pdserve-loadtest --trace multi_turn.jsonl --speedup 2 --goodput ttft:2000 tpot:100 --json replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
from pathlib import Path
import random
import re
import socket
import sys
import time
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.clients import ENDPOINTS, Result, send  # noqa: E402
from tools.goodput import attainment, goodput_by_slo, parse_slo_grid, print_goodput_table  # noqa: E402
from tools.loadgen import Work, arrival_offsets, draw_priority, parse_priority_mix, workloads  # noqa: E402
from tools.prefix_hits import prefix_hit_report, read_prefix_counters  # noqa: E402
from tools.stats import parse_goodput, per_priority, summarize  # noqa: E402
from tools.trace import MOONCAKE_BLOCK_SIZE, block_reuse, read_trace, send_offsets, trace_rate  # noqa: E402
from tools.trace import trace_workloads  # noqa: E402


def check_loopback(base_url: str) -> None:
    """Load goes to this machine only, unless --allow-remote says otherwise."""
    host = urlparse(base_url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as error:
        raise SystemExit(f"--base-url: cannot resolve {host!r}: {error}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise SystemExit(f"--base-url: {host} is not a loopback address; pass --allow-remote to load another host")


async def run_load(args: argparse.Namespace, work: list[Work], offsets: list[float]
                   ) -> tuple[list[Result], float, dict]:
    """Send ``work``'s warm-up requests, then the others, each ``offsets[i]`` seconds after the first
    (open loop) or as a client frees up (closed loop). Returns the measured results, the measured
    duration and what the server showed meanwhile: with --sample-replicas ``replicas``, with --trace
    ``prefix_cache`` (its engines' prefix hits over the measured requests)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=args.timeout + 30) as client:
        warm = [w for w in work if w.warmup]
        if warm:
            await asyncio.gather(*(send(client, args.endpoint, w, args.model, args.timeout) for w in warm))
        measured = [w for w in work if not w.warmup]
        prefix_before = await read_prefix_counters(client) if args.trace else None
        progress = _progress(len(measured), args.quiet)
        start = time.perf_counter()
        deadline = start + args.duration
        sampler = asyncio.create_task(_sample_replicas(client, args.sample_replicas, start)) \
            if args.sample_replicas else None
        if args.concurrency:
            results = await _closed_loop(client, args, measured, deadline, progress)
        else:
            results = await _open_loop(client, args, measured, offsets, start, deadline, progress)
        duration = time.perf_counter() - start
        progress.close()
        observed: dict = {}
        if sampler is not None:
            sampler.cancel()
            samples = await sampler
            last = await _replica_sample(client, start)  # and one as the load ends
            observed["replicas"] = replica_report(samples + ([last] if last is not None else []))
        if args.trace:
            prefix_after = await read_prefix_counters(client)
            if prefix_before is not None and prefix_after is not None:
                observed["prefix_cache"] = prefix_hit_report(prefix_before, prefix_after)
    return results, duration, observed


REPLICAS = re.compile(r'^pdserve_replicas\{deployment="(\w+)"\} (\S+)$', re.MULTILINE)
REPLICA_SAMPLES_MAX = 10_000  # a bound on the sampler's loop


async def _replica_sample(client: httpx.AsyncClient, start: float) -> dict | None:
    """{"t": seconds since start, deployment: running replicas, ...}; None if /metrics does not answer."""
    try:
        text = (await client.get("/metrics", timeout=10)).text
    except httpx.HTTPError:
        return None
    return {"t": round(time.perf_counter() - start, 2),
            **{name: int(float(value)) for name, value in REPLICAS.findall(text)}}


async def _sample_replicas(client: httpx.AsyncClient, every_s: float, start: float) -> list[dict]:
    """A replica sample every ``every_s`` until cancelled."""
    samples: list[dict] = []
    try:
        for _ in range(REPLICA_SAMPLES_MAX):
            sample = await _replica_sample(client, start)
            samples += [sample] if sample is not None else []
            await asyncio.sleep(every_s)
    except asyncio.CancelledError:
        pass
    return samples


def replica_report(samples: list[dict]) -> dict:
    """The samples, and the time-weighted mean P:D replica ratio when both deployments are there."""
    report: dict = {"samples": samples}
    pairs = [(s["t"], s["PrefillServer"] / s["DecodeServer"]) for s in samples
             if s.get("PrefillServer") and s.get("DecodeServer")]
    if len(pairs) > 1:
        spans = [(b[0] - a[0], a[1]) for a, b in zip(pairs, pairs[1:])]
        report["mean_pd_ratio"] = round(sum(dt * r for dt, r in spans) / sum(dt for dt, _ in spans), 3)
    return report


async def _open_loop(client, args, work: list[Work], offsets: list[float], start: float, deadline: float,
                     progress) -> list[Result]:
    """Each request sent ``offsets[i]`` seconds after ``start`` (none at or after ``deadline``)."""
    limit = asyncio.Semaphore(args.max_concurrency or len(work) or 1)
    tasks = []

    async def one(w: Work) -> Result:
        async with limit:
            result = await send(client, args.endpoint, w, args.model, args.timeout)
        progress.update(1)
        return result

    for w, offset in zip(work, offsets):
        if start + offset >= deadline:
            break
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(one(w)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client, args, work: list[Work], deadline: float, progress) -> list[Result]:
    pending = iter(work)
    results: list[Result] = []

    async def worker() -> None:
        for w in pending:  # shared iterator: each request is sent once
            if time.perf_counter() >= deadline:
                return
            results.append(await send(client, args.endpoint, w, args.model, args.timeout))
            progress.update(1)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=quiet, unit="req", file=sys.stderr)


def build_result(args, results: list[Result], duration: float, rate: float, observed: dict | None = None,
                 trace: dict | None = None) -> dict:
    """vLLM's summary of ``results``, per priority too; what the server showed (``observed``: replicas,
    prefix_cache), the replayed ``trace``'s description, and with --slo-grid each pair's attainment."""
    goodput = parse_goodput(args.goodput)
    result = {"endpoint": args.endpoint, "request_rate": rate, "burstiness": args.burstiness,
              "max_concurrency": args.concurrency or args.max_concurrency, "num_prompts": len(results),
              **summarize(results, duration, goodput), "per_priority": per_priority(results, duration, goodput),
              **(observed or {})}
    if trace is not None:
        result["trace"] = trace
    if args.slo_grid:
        result["slo_attainment"] = attainment(results, args.slo_grid)
    return result


def print_table(result: dict) -> None:
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", result["duration"]), ("Request throughput (req/s)", result["request_throughput"]),
            ("Output token throughput (tok/s)", result["output_throughput"])]
    if "request_goodput" in result:
        rows.append(("Request goodput (req/s)", result["request_goodput"]))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)", result[f"{stat}_{metric}_ms"]))
    print(f"{' Serving Benchmark Result ':=^52}")
    for name, value in rows:
        print(f"{name:<38}{value:>14.2f}" if isinstance(value, float) else f"{name:<38}{value:>14}")
    if result["errors"]:
        print(f"{'Errors by status':<38}{json.dumps(result['errors']):>14}")
    if len(result["per_priority"]) > 1:
        print(f"{'priority':<10}{'completed':>10}{'p50 TTFT':>12}{'p99 TTFT':>12}{'p99 TPOT':>12}")
        for p, r in result["per_priority"].items():
            print(f"{p:<10}{r['completed']:>10}{r['median_ttft_ms']:>12.1f}{r['p99_ttft_ms']:>12.1f}"
                  f"{r['p99_tpot_ms']:>12.1f}")
    if "replicas" in result:
        shown = None
        for sample in result["replicas"]["samples"]:  # each change of the counts
            counts = ", ".join(f"{k} {v}" for k, v in sample.items() if k != "t")
            if counts != shown:
                print(f"{'replicas at ' + str(sample['t']) + ' s':<24}{counts:>28}")
                shown = counts
        if "mean_pd_ratio" in result["replicas"]:
            print(f"{'Mean P:D replica ratio':<38}{result['replicas']['mean_pd_ratio']:>14.3f}")
    if "trace" in result:
        print(f"{'Trace block reuse':<38}{result['trace']['block_reuse']:>14.3f}")
    if "prefix_cache" in result:
        print(f"{'Prefix cache hit rate (tokens)':<38}{result['prefix_cache']['prefix_hit_rate']:>14.3f}")
    print("=" * 52)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve-loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --base-url")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="infer_token")
    p.add_argument("--model", default="tiny-llama", help="model name for /v1 endpoints")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests/s (open loop); inf (the default): all at once")
    p.add_argument("--burstiness", type=float, default=None, help="gamma shape of arrivals; 1 (the default) is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open loop)")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop with this many clients")
    p.add_argument("--num-requests", type=int, default=None, help="default 100; with --trace, the whole trace")
    p.add_argument("--duration", type=float, default=300.0, help="stop sending after this many seconds")
    p.add_argument("--input-len", default=None, help="N or LOW:HIGH (uniform); default 128")
    p.add_argument("--output-len", default=None, help="N or LOW:HIGH (uniform); default 64")
    p.add_argument("--dataset", type=Path, help='JSONL: {"prompt" or "input_ids", "output_len"} per line')
    p.add_argument("--trace", type=Path, help="replay a Mooncake-format JSONL trace (timestamp ms, input_length, "
                   "output_length, hash_ids): its times, lengths and shared prompt blocks")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"--trace: tokens per hash id (default {MOONCAKE_BLOCK_SIZE}, the Mooncake traces')")
    p.add_argument("--speedup", type=float, default=None,
                   help="--trace: replay this many times faster than recorded (default 1; 2 halves every gap)")
    p.add_argument("--token-range", default="3:800", help="LOW:HIGH of random prompt token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--priority-mix", default=None, help="e.g. 1:0.2,5:0.8")
    p.add_argument("--timeout", type=int, default=600, help="per-request timeout (s), sent to the server too")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and left out of the results")
    p.add_argument("--goodput", nargs="*", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--sweep", default=None, help="comma-separated request rates, run one after another")
    p.add_argument("--slo-grid", default=None, metavar="'ttft:MS,... tpot:MS,...'",
                   help="SLO attainment per (TTFT, TPOT) pair for each run; with --sweep, goodput per pair")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="directory for PNG plots")
    p.add_argument("--sample-replicas", type=float, default=None, metavar="SECONDS",
                   help="read the server's /metrics this often and report its replicas over the run (P:D ratio)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    _check_trace_options(p, args)
    for name in ("num_requests", "concurrency", "max_concurrency", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')}: must be positive")
    if args.request_rate <= 0 or args.duration <= 0 or args.burstiness <= 0:
        p.error("--request-rate, --duration and --burstiness must be > 0")
    if args.sample_replicas is not None and args.sample_replicas <= 0:
        p.error("--sample-replicas: must be > 0")
    if args.slo_grid is not None:
        try:
            args.slo_grid = parse_slo_grid(args.slo_grid)
        except ValueError as error:
            p.error(str(error))
    return args


SET_BY_THE_TRACE = ("request_rate", "burstiness", "input_len", "output_len", "dataset", "concurrency", "sweep")
DEFAULTS = {"request_rate": float("inf"), "burstiness": 1.0, "input_len": "128", "output_len": "64"}


def _check_trace_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A trace sets the arrivals and lengths: an option that would set them too is refused, as are the
    trace's own options without one. Then the defaults of the options left unset."""
    if args.trace is not None:
        given = [f"--{n.replace('_', '-')}" for n in SET_BY_THE_TRACE if getattr(args, n) is not None]
        if given:
            p.error(f"--trace sets the arrivals and lengths; {', '.join(given)} cannot be combined with it")
        args.block_size = MOONCAKE_BLOCK_SIZE if args.block_size is None else args.block_size
        args.speedup = 1.0 if args.speedup is None else args.speedup
        if args.block_size < 1 or args.speedup <= 0:
            p.error("--block-size must be >= 1 and --speedup > 0")
    elif args.block_size is not None or args.speedup is not None:
        p.error("--block-size and --speedup are --trace's options")
    for name, default in DEFAULTS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))


def _trace_load(args: argparse.Namespace, token_range: tuple[int, int]) -> tuple[list[Work], list[float], dict]:
    """The trace's first --num-requests records as work (after --warmup short random requests that share
    no block with it), their send offsets, and the trace's description for the result."""
    try:
        records = read_trace(args.trace, args.block_size)[:args.num_requests]
    except (OSError, ValueError) as error:
        raise SystemExit(f"--trace: {error}") from None
    rng, mix = random.Random(args.seed), parse_priority_mix(args.priority_mix)
    work = workloads(0, "16", "4", args.seed, args.priority_mix, token_range, warmup=args.warmup)
    work += trace_workloads(records, args.block_size, token_range, [draw_priority(rng, mix) for _ in records],
                            args.seed)
    offsets = send_offsets(records, args.speedup)
    trace = {"file": str(args.trace), "requests": len(records), "block_size": args.block_size,
             "speedup": args.speedup, "span_s": offsets[-1], "offered_rate": trace_rate(records, args.speedup),
             **block_reuse(records)}
    return work, offsets, trace


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.allow_remote:
        check_loopback(args.base_url)
    low, high = (int(x) for x in args.token_range.split(":"))
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    runs = []
    for i, rate in enumerate(rates):
        trace = None
        if args.trace:
            work, offsets, trace = _trace_load(args, (low, high))
            rate = trace["offered_rate"]
        else:
            count = args.num_requests or 100
            work = workloads(count, args.input_len, args.output_len, args.seed + i, args.priority_mix, (low, high),
                             args.dataset, args.warmup)
            offsets = arrival_offsets(rate, args.burstiness, args.seed, count)
        results, duration, observed = asyncio.run(run_load(args, work, offsets))
        run = build_result(args, results, duration, rate, observed, trace)
        run["_results"] = results
        runs.append(run)
        if not args.quiet:
            print_table(run)
    if args.plot:
        from tools.plots import write_plots

        write_plots(args.plot, runs)
    for run in runs:
        run.pop("_results")
    output = runs[0] if len(runs) == 1 else {"sweep": runs}
    if args.slo_grid and len(runs) > 1:
        output["goodput_by_slo"] = goodput_by_slo(runs)
        if not args.quiet:
            print_goodput_table({"this app": output["goodput_by_slo"]}, "Goodput by SLO")
    if args.json:
        args.json.write_text(json.dumps(output, indent=2))
    return output


def entry_point() -> None:
    main()


if __name__ == "__main__":
    entry_point()
