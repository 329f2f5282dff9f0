"""PD against colocated on the same machine and cores, and Ray Serve's overhead.

Starts each app alone on this machine's two cores: colocated gives its one engine both; the PD
apps give P and D one torch thread each. "pd" is prefix-aware PD as configured by default
(decode-side reuse, local prefill of short rests, deployments/pd/disaggregation.py); "pd-whole" is
PD that sends every prompt whole through P (``pd_decode_prefix_reuse=false``,
``pd_local_prefill_tokens=0``), the PD of before; "pd-slo" is "pd" given the SLOs (PD_SLO) its
policy weighs (docs/serving.md). Runs the same rate sweep of three workloads
against each (chat-like: 64-256 in / 32 out; prefill-heavy: 1024 / 16; multi-turn: conversations
of 4 turns over a 1024-token system prompt, 64 new tokens and 32 out per turn), prints goodput,
p99 TTFT and p99 TPOT side by side with ratios to colocated, and for the PD apps the KV bytes
sent per request (per conversation on multi-turn), D's prefix-cache hit rate and the share of
prompts D computed itself. With --slo-sweep, goodput as DistServe defines it instead
(tools/goodput.py): each workload, and a fourth of long prompts (2048-4000 in / 32 out), swept
over rates of its own (SLO_RATES) up past saturation, the attainment of every SLO pair of the grid
at each rate, the goodput per pair and app side by side, and an attainment plot per workload.
There the apps are deployed together and take turns at each rate (one loaded at a time), so
that what else runs on a shared machine weighs on each alike.
Otherwise, after the sweeps, the serving overhead: TTFT and time per token of single
sequential requests over HTTP + Ray Serve against the in-process engine on the same prompts.
Beside it, the floor: the same ingress over an engine deployment that answers at once (no
model), i.e. what the proxy, the ingress and the hops cost on this machine when nothing else runs.

    python benchmarks/serving_compare.py [--rates 2,4,8] [--num-requests 40] [--json PATH]
    python benchmarks/serving_compare.py --slo-sweep [--plot DIR]  # goodput per SLO pair, four workloads
    python benchmarks/serving_compare.py --overhead-only     # the serving overhead alone
    python benchmarks/serving_compare.py --threshold-scan    # TTFT on P vs on D by prompt length
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
import re
import statistics
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.conversations import run_conversations  # noqa: E402
from deployments.app import colocated_app, pd_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.ingress.ingress import Ingress  # noqa: E402
from deployments.replicas.liveness import Accepted, replica_id  # noqa: E402
from engine.model_info import ModelInfo  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.outputs import LENGTH, RequestOutput  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from tests.serving import deploy, serve_session  # noqa: E402
from tools.clients import send_each  # noqa: E402
from tools.goodput import DEFAULT_SLO_GRID, attainment, goodput_by_slo, parse_slo_grid  # noqa: E402
from tools.goodput import print_goodput_table  # noqa: E402
from tools.loadgen import workloads  # noqa: E402
from tools.loadtest import main as loadtest  # noqa: E402
from tools.stats import parse_goodput, summarize  # noqa: E402

WORKLOADS = {"chat-like": ("64:256", "32"), "prefill-heavy": ("1024", "16"), "multi-turn": None}
LONG_PROMPT = ("2048:4000", "32")  # tiny-llama's context is 4096 tokens
SLO_RATES = {  # per workload, up past what an app on two cores sustains (req/s); the targets first
    "prefill-heavy": (2, 4, 8, 16, 24), "long-prompt": (1, 2, 4, 6, 8), "chat-like": (4, 8, 16, 32, 48),
    "multi-turn": (2, 4, 8, 16, 24)}
LOAD_SECONDS = 4  # an SLO sweep's run sends at least this many seconds of arrivals at its rate
MULTI_TURN = {"turns": 4, "system_len": 1024, "user_len": 64, "output_len": 32}
GOODPUT = ["ttft:2000", "tpot:100"]
PD_WHOLE = {"pd_decode_prefix_reuse": False, "pd_local_prefill_tokens": 0}
PD_SLO = {"slo_ttft_ms": 2000, "slo_tpot_ms": 50}  # conditional PD told the middle pair of the SLO grid
APPS = {  # how the two cores are split
    "colocated": lambda: colocated_app({"torch_threads": 2, "embeddings": False},
                                       {"ray_actor_options": {"num_cpus": 2}}),
    "pd-whole": lambda: pd_app({"torch_threads": 1, "embeddings": False, **PD_WHOLE},
                               {"ray_actor_options": {"num_cpus": 1}}, {"ray_actor_options": {"num_cpus": 1}}),
    "pd": lambda: pd_app({"torch_threads": 1, "embeddings": False},
                         {"ray_actor_options": {"num_cpus": 1}}, {"ray_actor_options": {"num_cpus": 1}}),
    "pd-slo": lambda: pd_app({"torch_threads": 1, "embeddings": False, **PD_SLO},
                             {"ray_actor_options": {"num_cpus": 1}}, {"ray_actor_options": {"num_cpus": 1}}),
}
COUNTERS = {  # what each run adds to the server's figures (/metrics)
    "kv_bytes": r"^pdserve_kv_bytes_moved (\S+)$",
    "d_prefix_queries": r'^pdserve_prefix_cache_queries\{deployment="DecodeServer"\} (\S+)$',
    "d_prefix_hits": r'^pdserve_prefix_cache_hits\{deployment="DecodeServer"\} (\S+)$',
    "p_prefix_queries": r'^pdserve_prefix_cache_queries\{deployment="PrefillServer"\} (\S+)$',
    "p_prefix_hits": r'^pdserve_prefix_cache_hits\{deployment="PrefillServer"\} (\S+)$',
    "local": r'^pdserve_pd_prefill_decisions\{reason="\w+",where="decode"\} (\S+)$',
    "remote": r'^pdserve_pd_prefill_decisions\{reason="\w+",where="prefill"\} (\S+)$',
}
OVERHEAD_PROMPTS = 40  # sequential requests; the first OVERHEAD_WARMUP are not counted
OVERHEAD_WARMUP = 4


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EchoEngine:
    """A measuring instrument, not a server: an engine deployment that streams
    ``max_new_tokens`` outputs at once, so that a request's time is the serving path's alone."""

    def info(self) -> ModelInfo:
        return ModelInfo("echo", "echo", vocab_size=1 << 20, max_model_len=1 << 20, max_iter_times=1 << 20, node_id="",
                         dtype="float32", enable_prefix_caching=False, pad_token_id=0, hidden_size=0,
                         attention_backend="none", batch_invariant=False)

    async def generate(self, request: GenerationRequest):
        yield Accepted(replica_id())  # as the engine servers do (deployments/replicas/liveness.py)
        n = request.params.max_new_tokens
        for i in range(1, n + 1):  # one output per batch: an engine that keeps up with its reader
            yield [RequestOutput(request.request_id, [i], "x", i, i == n, LENGTH if i == n else None, 0)]


def counters(url: str) -> dict[str, float]:
    """The COUNTERS' current values (summed over their label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {name: sum(float(v) for v in re.findall(pattern, text, re.MULTILINE)) for name, pattern in COUNTERS.items()}


def one_run(url: str, workload: str, rate: float, num_requests: int, seed: int, slo_grid: str | None = None
            ) -> dict:
    """One workload at one offered rate: the load tester's summary (with ``slo_grid``, the SLO attainment
    of each pair too), and the server's figures for it.
    Each run has prompts of its own (``seed``): none finds an earlier run's in a prefix cache."""
    before = counters(url)
    if workload == "multi-turn":
        conversations = num_requests // MULTI_TURN["turns"]
        results, duration = asyncio.run(run_conversations(url, conversations, rate=rate, seed=seed, **MULTI_TURN))
        run = {"request_rate": rate, "conversations": conversations,
               **summarize(results, duration, parse_goodput(GOODPUT))}
        if slo_grid:
            run["slo_attainment"] = attainment(results, parse_slo_grid(slo_grid))
    else:
        input_len, output_len = LONG_PROMPT if workload == "long-prompt" else WORKLOADS[workload]
        run = loadtest(["--base-url", url, "--num-requests", str(num_requests), "--input-len", input_len,
                        "--output-len", output_len, "--request-rate", str(rate), "--goodput", *GOODPUT, "--quiet",
                        "--warmup", "2", "--seed", str(seed), *(["--slo-grid", slo_grid] if slo_grid else [])])
    after = counters(url)
    run["server"] = {name: after[name] - before[name] for name in COUNTERS}
    return run


def sweep(url: str, rates: str, num_requests: int) -> dict:
    return {name: [one_run(url, name, float(rate), num_requests, seed=7 + 100 * i)
                   for i, rate in enumerate(rates.split(","))] for name in WORKLOADS}


def slo_sweep(urls: dict[str, str], rates: str | None, min_requests: int, slo_grid: str, json_path: Path | None
              ) -> dict:
    """Every workload over its SLO_RATES (or ``rates`` for all), each run at least ``min_requests``
    and LOAD_SECONDS of arrivals (a multiple of a conversation's turns on multi-turn), the machine's
    load (os.getloadavg) beside each run. The apps (name -> base URL, all deployed) take turns at
    each rate, with the same prompts: a change in what else runs on the machine falls on all of
    them alike, not on whichever app came last."""
    out: dict = {app: {"slo_sweep": {}} for app in urls}
    for name, default_rates in SLO_RATES.items():
        for i, rate in enumerate([float(r) for r in rates.split(",")] if rates else default_rates):
            turns = MULTI_TURN["turns"]
            n = -(-max(min_requests, int(LOAD_SECONDS * rate)) // turns) * turns
            for app, url in urls.items():
                run = one_run(url, name, float(rate), n, seed=7 + 100 * i, slo_grid=slo_grid)
                run["loadavg"] = os.getloadavg()
                out[app]["slo_sweep"].setdefault(name, []).append(run)
                print(f"{name:<15}{rate:>6g} req/s {n:>4} requests {app:>10}  p99 TTFT {run['p99_ttft_ms']:8.1f} ms"
                      f"  p99 TPOT {run['p99_tpot_ms']:6.1f} ms  load {run['loadavg'][0]:.2f}", flush=True)
        if json_path:  # kept as each workload ends: a later failure does not lose the earlier ones
            json_path.write_text(json.dumps({"results": out}, indent=2))
    return out


def report_goodput(results: dict, plot_dir: Path | None) -> dict:
    """Goodput per SLO pair, per workload and app; the tables printed, an attainment PNG per workload."""
    table = {}
    for name in SLO_RATES:
        by_app = {app: results[app]["slo_sweep"][name] for app in results}
        table[name] = {app: goodput_by_slo(runs) for app, runs in by_app.items()}
        print_goodput_table(table[name], name)
        if plot_dir:
            from tools.plots import slo_attainment_plot

            plot_dir.mkdir(parents=True, exist_ok=True)
            slo_attainment_plot(plot_dir / f"slo_attainment_{name}.png", by_app, f"SLO attainment, {name}")
    return table


SCAN_LENGTHS = (32, 64, 128, 256, 512, 1024)
SCAN_REPEATS = 6  # sequential requests per length; the first is not counted


def threshold_scan() -> dict:
    """Median TTFT and time to the second token (ms) of single sequential requests by prompt length,
    prefilled on P and handed over vs prefilled on D: what a hand-off costs a request, beside what
    a local prefill costs D (the chat-like sweep), for the default of pd_local_prefill_tokens."""
    out = {}
    for where, local in (("prefill", 0), ("decode", 1 << 20)):
        with serve_session() as url:
            serve.run(pd_app({"torch_threads": 1, "embeddings": False, "pd_decode_prefix_reuse": False,
                              "pd_local_prefill_tokens": local},
                             {"ray_actor_options": {"num_cpus": 1}}, {"ray_actor_options": {"num_cpus": 1}}),
                      name="scan", route_prefix="/")
            out[where] = {}
            for length in SCAN_LENGTHS:
                prompts = workloads(SCAN_REPEATS, str(length), "8", length, None, (3, 800))
                firsts, seconds = [], []
                for result in asyncio.run(send_each(url, prompts)):
                    assert result.ok, result.error
                    firsts.append(result.ttft * 1e3)
                    seconds.append((result.ttft + result.itl[0]) * 1e3)
                out[where][length] = (statistics.median(firsts[1:]), statistics.median(seconds[1:]))
    print(f"{'prompt tokens':<15}{'on P: TTFT':>12}{'2nd token':>11}{'on D: TTFT':>12}{'2nd token':>11}")
    for length in SCAN_LENGTHS:
        (p1, p2), (d1, d2) = out["prefill"][length], out["decode"][length]
        print(f"{length:<15}{p1:>12.1f}{p2:>11.1f}{d1:>12.1f}{d2:>11.1f}")
    return out


def http_latency(url: str, prompts) -> tuple[float, float]:
    """Mean TTFT and mean time per token (ms) of single requests sent one after another."""
    results = asyncio.run(send_each(url, prompts))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    results = results[OVERHEAD_WARMUP:]
    return (statistics.mean(r.ttft for r in results) * 1e3, statistics.mean(r.tpot for r in results) * 1e3)


def engine_latency(prompts, threads: int) -> tuple[float, float]:
    """The same measurement on the engine in this process (no HTTP, no Ray)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", torch_threads=threads))
    ttfts, tpots = [], []
    for w in prompts[OVERHEAD_WARMUP:]:
        start = time.perf_counter()
        engine.add_request(GenerationRequest(f"r{w.index}", w.input_ids,
                                             SamplingParams(max_new_tokens=w.output_len, ignore_eos=True)))
        first = None
        while engine.has_work():
            outputs = engine.step()
            if outputs and first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - start)
        tpots.append((end - first) / (w.output_len - 1))
    return statistics.mean(ttfts) * 1e3, statistics.mean(tpots) * 1e3


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rates", default=None, help="offered request rates (req/s), comma-separated; "
                        "default 2,4,8 (with --slo-sweep: SLO_RATES, per workload)")
    parser.add_argument("--num-requests", type=int, default=40, help="per run (with --slo-sweep: at least)")
    parser.add_argument("--slo-sweep", action="store_true", help="goodput per SLO pair instead of the comparison")
    parser.add_argument("--slo-grid", default=DEFAULT_SLO_GRID, help="with --slo-sweep: 'ttft:MS,... tpot:MS,...'")
    parser.add_argument("--plot", type=Path, help="with --slo-sweep: a directory for the attainment PNGs")
    parser.add_argument("--overhead-only", action="store_true", help="skip the sweeps")
    parser.add_argument("--threshold-scan", action="store_true", help="only TTFT on P vs on D by prompt length")
    parser.add_argument("--apps", default=",".join(APPS), help="the apps to sweep, comma-separated")
    args = parser.parse_args()
    if args.threshold_scan:
        scan = threshold_scan()
        write_json(args.json, scan)
        return
    if args.slo_sweep:
        parse_slo_grid(args.slo_grid)  # refuse a bad grid before any app starts
        apps = args.apps.split(",")
        with serve_session() as url:
            deploy({app: APPS[app]() for app in apps})  # side by side, at /<app>; idle while another is loaded
            results = slo_sweep({app: f"{url}/{app}" for app in apps}, args.rates, args.num_requests,
                                args.slo_grid, args.json)
        table = report_goodput(results, args.plot)
        write_json(args.json, {"results": results, "goodput": table})
        return
    args.rates = args.rates or "2,4,8"
    prompts = workloads(OVERHEAD_PROMPTS, "128", "32", 11, None, (3, 800))
    results = {}
    for app in args.apps.split(","):
        build = APPS[app]
        with serve_session() as url:
            serve.run(build(), name=app, route_prefix="/")
            sweeps = {} if args.overhead_only else sweep(url, args.rates, args.num_requests)
            results[app] = {"sweep": sweeps, "http": http_latency(url, prompts)}
    if not args.overhead_only:
        report_sweeps(results)
        write_json(args.json, {"results": results})
    with serve_session() as url:
        serve.run(Ingress.bind(AppArgs(embeddings=False), llm=EchoEngine.bind()), name="floor", route_prefix="/")
        floor = http_latency(url, prompts)
    engine = {app: engine_latency(prompts, 2 if app == "colocated" else 1) for app in results}
    report_overhead(results, engine, floor)
    write_json(args.json, {"results": results, "engine": engine, "floor": floor})


def report_sweeps(results: dict) -> None:
    apps = list(results)
    print(f"{'workload':<15}{'rate':>6}{'metric':>16}" + "".join(f"{a:>11}" for a in apps)
          + "".join(f"{a + '/co':>12}" for a in apps if a != "colocated"))
    for name in WORKLOADS:
        runs = list(zip(*(results[a]["sweep"][name] for a in apps)))
        for by_app in runs:
            rate = by_app[0]["request_rate"]
            for metric in ("request_goodput", "p99_ttft_ms", "p99_tpot_ms"):
                values = {a: r[metric] for a, r in zip(apps, by_app)}
                co = values.get("colocated")
                ratios = "".join(f"{values[a] / co if co else float('nan'):>12.2f}" for a in apps if a != "colocated")
                print(f"{name:<15}{rate:>6.1f}{metric:>16}" + "".join(f"{values[a]:>11.2f}" for a in apps) + ratios)
    print(f"\n{'workload':<15}{'rate':>6}{'app':>10}{'KV MB/req':>11}{'KV MB/conv':>12}{'D hit %':>9}"
          f"{'P hit %':>9}{'on D %':>8}")
    for name in WORKLOADS:
        for app in apps:
            if app == "colocated":
                continue
            for run in results[app]["sweep"][name]:
                server, done = run["server"], max(run["completed"], 1)
                per_conv = server["kv_bytes"] / run["conversations"] / 1e6 if "conversations" in run else float("nan")
                d_hit = 100 * server["d_prefix_hits"] / server["d_prefix_queries"] if server["d_prefix_queries"] else 0
                p_hit = 100 * server["p_prefix_hits"] / server["p_prefix_queries"] if server["p_prefix_queries"] else 0
                decided = server["local"] + server["remote"]
                local = 100 * server["local"] / decided if decided else 0.0
                print(f"{name:<15}{run['request_rate']:>6.1f}{app:>10}{server['kv_bytes'] / done / 1e6:>11.3f}"
                      f"{per_conv:>12.3f}{d_hit:>9.1f}{p_hit:>9.1f}{local:>8.1f}")


def report_overhead(results: dict, engine: dict, floor: tuple[float, float]) -> None:
    n = OVERHEAD_PROMPTS - OVERHEAD_WARMUP
    print(f"\nserving overhead, means of {n} sequential requests (128 tokens in, 32 out)")
    print(f"{'':<20}{'TTFT ms (HTTP / engine / +)':>32}{'ms per token (HTTP / engine / +)':>36}")
    for app in results:
        (h_ttft, h_tpot), (e_ttft, e_tpot) = results[app]["http"], engine[app]
        print(f"{app:<20}{h_ttft:>12.2f}{e_ttft:>10.2f}{h_ttft - e_ttft:>10.2f}"
              f"{h_tpot:>14.2f}{e_tpot:>10.2f}{h_tpot - e_tpot:>10.2f}")
    print(f"{'floor (no model)':<20}{floor[0]:>12.2f}{0:>10.2f}{floor[0]:>10.2f}"
          f"{floor[1]:>14.2f}{0:>10.2f}{floor[1]:>10.2f}")


if __name__ == "__main__":
    main()
