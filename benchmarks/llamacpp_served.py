"""The shipped GGUF served over HTTP by pdserve and by llama.cpp's own server, back to back (issue 57).

One run, one machine, the same file (models/SmolLM2-135M-Instruct.Q4_1.gguf), the same token-id
prompts, the same thread count: ``llama-server`` (built by ``make bench-llamacpp`` from the
llama-cpp-python 0.3.36 source into build/llamacpp; ``-t``/``-tb`` threads, 32 slots, continuous
batching) and pdserve's colocated app (what ``serve run`` starts with one engine, its defaults:
dtype auto, the file's quantized types kept, ``torch_threads`` threads and as many Ray CPUs).
For each server: start it, a small warm-up round, then per workload a warm-up round and
``--rounds`` measured rounds with fresh prompts (no prefix-cache hit), streamed
``/v1/completions``, greedy, EOS ignored, output tokens read from each stream's final usage
(benchmarks/served_vs_vllm.py's client). Workloads (the issue's): one stream 128 -> 128 and
32 x 128 -> 64. Then, to place the served single stream: one more such request to pdserve with the
CPU each of the app's processes used meanwhile (engine replica, ingress, Serve proxy, Ray daemons:
benchmarks/stream_throughput.py's roles), per output token; and the same request in process
(LLMEngine alone, the app's engine settings and threads, after two warm-up requests): what the
HTTP and serving path add is the rest.

Prints output tok/s per round and the ratio of pdserve's mean to llama.cpp's.

    python benchmarks/llamacpp_served.py [--model FILE.gguf] [--threads 2] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import asyncio
from pathlib import Path
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.served_vs_vllm import START_LIMIT_S, Workload, _healthy, _mean, measure, run_round  # noqa: E402
from benchmarks.stream_throughput import cpu_by_role, cpu_seconds  # noqa: E402
from tests.serving import free_port, serve_session, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_SERVER = ROOT / "build" / "llamacpp" / "build" / "bin" / "llama-server"  # the Makefile's LLAMACPP_BIN
SLOTS = 32
WORKLOADS = [Workload(1, 128, 128), Workload(32, 128, 64)]


def run_llamacpp(server: Path, model: Path, threads: int, rounds: int) -> dict:
    """llama-server on ``threads`` threads with SLOTS slots of 512 tokens each (the longest request: 256)."""
    port = free_port()
    command = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * 512), "--no-webui"]
    log = Path(tempfile.gettempdir()) / f"llama-server-{port}.log"
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until(lambda: _healthy(url) or process.poll() is not None, 300, 1) or process.poll():
            raise RuntimeError(f"llama-server did not start; its log:\n{log.read_text()[-3000:]}")
        return measure(url, WORKLOADS, rounds)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def engine_args(model: Path, threads: int) -> dict:
    return {"model": str(model), "served_model_name": "bench", "torch_threads": threads, "embeddings": False}


def run_pdserve(model: Path, threads: int, rounds: int) -> dict:
    from ray import serve

    from deployments.app import colocated_app

    with serve_session() as url:
        serve.run(colocated_app(engine_args(model, threads), {"ray_actor_options": {"num_cpus": threads}}),
                  name="colocated", route_prefix="/")
        assert wait_until(lambda: _healthy(url), START_LIMIT_S, 2), "pdserve did not become healthy"
        return measure(url, WORKLOADS, rounds) | {"single stream CPU": single_stream_cpu(url)}


def single_stream_cpu(url: str) -> dict:
    """Where the served single stream's time goes: one more 128 -> 128 request, with the CPU each of
    the app's processes used meanwhile (by Ray process title), in ms per output token."""
    workload = WORKLOADS[0]
    before = cpu_seconds()
    result = asyncio.run(run_round(url, workload.prompts(9000), workload.output_len))
    used = cpu_by_role(before, cpu_seconds())
    return {"wall_ms_per_token": 1000 / result["tok_s"],
            "cpu_ms_per_token": {role: 1000 * seconds / workload.output_len for role, seconds in sorted(used.items())}}


# A fresh process's first two requests run ~25% slower than the rest (71 against 93-97 tok/s on the
# shipped GGUF, benchmarks/RESULTS.md issue 57 session 9): the served replica is long warm when timed.
IN_PROCESS_WARM_UPS = 2


def in_process_single_stream(model: Path, threads: int, rounds: int) -> list[float]:
    """The single stream's tok/s (output tokens over the request's whole time) in LLMEngine alone."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import GenerationRequest
    from sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=str(model)))
    workload = WORKLOADS[0]
    params = SamplingParams(max_new_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    rates = []
    for r in range(rounds + IN_PROCESS_WARM_UPS):
        start = time.perf_counter()
        result = engine.generate([GenerationRequest(f"s{r}", workload.prompts(1000 + r)[0], params)])[f"s{r}"]
        rates.append(len(result.output_token_ids) / (time.perf_counter() - start))
    return rates[IN_PROCESS_WARM_UPS:]


def _exit_on_sigterm(signum, frame) -> None:
    """``timeout`` (or flock's) ends the script with SIGTERM: exit through the ``finally`` blocks, so
    that llama-server (a session of its own) is stopped too, not left serving the cut round's requests
    on both cores for minutes, under the next benchmark."""
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = bench_parser(__doc__)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per workload, after a warm-up")
    parser.add_argument("--servers", default="llama.cpp,pdserve", help="which to run (the ratio needs both)")
    args = parser.parse_args()
    servers = args.servers.split(",")
    if "llama.cpp" in servers and not args.llama_server.exists():
        sys.exit(f"{args.llama_server} is missing: make bench-llamacpp builds it")
    results = {}
    if "llama.cpp" in servers:
        results["llama.cpp"] = run_llamacpp(args.llama_server, args.model, args.threads, args.rounds)
    if "pdserve" in servers:
        results["pdserve"] = run_pdserve(args.model, args.threads, args.rounds)
    in_process = in_process_single_stream(args.model, args.threads, args.rounds)
    print(f"{args.model.name} over HTTP, {args.threads} threads each; output tok/s of each round "
          "(mean TTFT s), pdserve's mean / llama.cpp's")
    ratios = {}
    for w in WORKLOADS:
        for server, measured in results.items():
            rounds = measured[w.name]
            ratio = ""
            if server == "pdserve" and "llama.cpp" in results:
                ratios[w.name] = _mean(rounds, "tok_s") / _mean(results["llama.cpp"][w.name], "tok_s")
                ratio = f"  {ratios[w.name]:.2f}x"
            print(f"{w.name:>18}  {server:<10} " + " ".join(f"{r['tok_s']:7.1f}" for r in rounds)
                  + f"  ({_mean(rounds, 'mean_ttft_s'):.3f}){ratio}")
    served = (f"  served / in process {_mean(results['pdserve'][WORKLOADS[0].name], 'tok_s') / (sum(in_process) / len(in_process)):.2f}"
              if "pdserve" in results else "")
    print(f"{WORKLOADS[0].name:>18}  in process " + " ".join(f"{rate:7.1f}" for rate in in_process) + served)
    if "pdserve" in results:
        profile = results["pdserve"]["single stream CPU"]
        print(f"pdserve's single stream, one more request: {profile['wall_ms_per_token']:.1f} ms per token; CPU ms per "
              "token: " + ", ".join(f"{role} {ms:.1f}" for role, ms in profile["cpu_ms_per_token"].items()))
    write_json(args.json, {"model": str(args.model), "threads": args.threads, "results": results,
                           "in_process_single_stream_tok_s": in_process, "ratios": ratios})


if __name__ == "__main__":
    main()
