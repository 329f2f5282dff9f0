"""PD against colocated on the same machine and cores, and Ray Serve's overhead.

Starts the PD app, then the colocated app, each alone on this machine's two cores: PD gives
P and D one torch thread each, colocated gives its one engine both. Runs the same rate sweep
of three workloads against each (chat-like: 64-256 in / 32 out; prefill-heavy: 1024 / 16;
decode-heavy: 32 / 128), prints goodput, p99 TTFT and p99 TPOT side by side with ratios, and
measures the serving overhead: TTFT and time per token of single sequential requests over
HTTP + Ray Serve against the in-process engine on the same prompts. Beside it, the floor: the
same ingress over an engine deployment that answers at once (no model), i.e. what the proxy,
the ingress and the hops cost on this machine when nothing else runs.

    python benchmarks/serving_compare.py [--rates 2,4,8] [--num-requests 40] [--json PATH]
    python benchmarks/serving_compare.py --overhead-only     # the serving overhead alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
import statistics
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.clients import send  # noqa: E402
from benchmarks.loadgen import workloads  # noqa: E402
from benchmarks.loadtest import main as loadtest  # noqa: E402
from deployments.app import colocated_app, pd_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.ingress import Ingress  # noqa: E402
from deployments.servers import ModelInfo  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.outputs import LENGTH, RequestOutput  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from tests.serving import serve_session  # noqa: E402

WORKLOADS = {"chat-like": ("64:256", "32"), "prefill-heavy": ("1024", "16"), "decode-heavy": ("32", "128")}
GOODPUT = ["ttft:2000", "tpot:100"]
APPS = {  # how the two cores are split
    "pd": lambda: pd_app({"torch_threads": 1, "embeddings": False},
                         {"ray_actor_options": {"num_cpus": 1}}, {"ray_actor_options": {"num_cpus": 1}}),
    "colocated": lambda: colocated_app({"torch_threads": 2, "embeddings": False},
                                       {"ray_actor_options": {"num_cpus": 2}}),
}
OVERHEAD_PROMPTS = 40  # sequential requests; the first OVERHEAD_WARMUP are not counted
OVERHEAD_WARMUP = 4


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EchoEngine:
    """A measuring instrument, not a server: an engine deployment that streams
    ``max_new_tokens`` outputs at once, so that a request's time is the serving path's alone."""

    def info(self) -> ModelInfo:
        return ModelInfo("echo", "echo", vocab_size=1 << 20, max_model_len=1 << 20, max_iter_times=0, node_id="")

    async def generate(self, request: GenerationRequest):
        n = request.params.max_new_tokens
        for i in range(1, n + 1):
            yield RequestOutput(request.request_id, [i], "x", i, i == n, LENGTH if i == n else None, 0)


def sweep(url: str, rates: str, num_requests: int) -> dict:
    out = {}
    for name, (input_len, output_len) in WORKLOADS.items():
        result = loadtest(["--base-url", url, "--num-requests", str(num_requests), "--input-len", input_len,
                           "--output-len", output_len, "--sweep", rates, "--goodput", *GOODPUT, "--quiet",
                           "--warmup", "2", "--seed", "7"])
        out[name] = result["sweep"] if "sweep" in result else [result]
    return out


def http_latency(url: str, prompts) -> tuple[float, float]:
    """Mean TTFT and mean time per token (ms) of single requests sent one after another."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return [await send(client, "infer_token", w, "tiny-llama", 120) for w in prompts]

    results = asyncio.run(run())
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,4,8", help="offered request rates (req/s), comma-separated")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--overhead-only", action="store_true", help="skip the sweeps")
    args = parser.parse_args()
    prompts = workloads(OVERHEAD_PROMPTS, "128", "32", 11, None, (3, 800))
    results = {}
    for app, build in APPS.items():
        with serve_session() as url:
            serve.run(build(), name=app, route_prefix="/")
            sweeps = {} if args.overhead_only else sweep(url, args.rates, args.num_requests)
            results[app] = {"sweep": sweeps, "http": http_latency(url, prompts)}
    with serve_session() as url:
        serve.run(Ingress.bind(AppArgs(embeddings=False), llm=EchoEngine.bind()), name="floor", route_prefix="/")
        floor = http_latency(url, prompts)
    engine = {app: engine_latency(prompts, 1 if app == "pd" else 2) for app in APPS}
    if not args.overhead_only:
        report_sweeps(results)
    report_overhead(results, engine, floor)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "engine": engine, "floor": floor}, indent=2))


def report_sweeps(results: dict) -> None:
    print(f"{'workload':<15}{'rate':>6}{'metric':>14}{'PD':>10}{'colocated':>11}{'PD/co':>8}")
    for name in WORKLOADS:
        for pd_run, co_run in zip(results["pd"]["sweep"][name], results["colocated"]["sweep"][name]):
            for metric in ("request_goodput", "p99_ttft_ms", "p99_tpot_ms"):
                pd_v, co_v = pd_run[metric], co_run[metric]
                ratio = pd_v / co_v if co_v else float("nan")
                print(f"{name:<15}{pd_run['request_rate']:>6.1f}{metric:>14}{pd_v:>10.2f}{co_v:>11.2f}{ratio:>8.2f}")


def report_overhead(results: dict, engine: dict, floor: tuple[float, float]) -> None:
    n = OVERHEAD_PROMPTS - OVERHEAD_WARMUP
    print(f"\nserving overhead, means of {n} sequential requests (128 tokens in, 32 out)")
    print(f"{'':<20}{'TTFT ms (HTTP / engine / +)':>32}{'ms per token (HTTP / engine / +)':>36}")
    for app in results:
        (h_ttft, h_tpot), (e_ttft, e_tpot) = results[app]["http"], engine[app]
        print(f"{app:<20}{h_ttft:>12.2f}{e_ttft:>10.2f}{h_ttft - e_ttft:>10.2f}"
              f"{h_tpot:>14.2f}{e_tpot:>10.2f}{h_tpot - e_tpot:>10.2f}")
    print(f"{'floor (no model)':<20}{floor[0]:>12.2f}{0:>10.2f}{floor[0]:>10.2f}{floor[1]:>14.2f}{0:>10.2f}{floor[1]:>10.2f}")


if __name__ == "__main__":
    main()
