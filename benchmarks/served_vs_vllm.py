"""Served tokens per second: pdserve's colocated and PD apps against vLLM's OpenAI server, over HTTP.

One run, one machine, back to back, the same model directory and the same token ids: a random
model shaped like SmolLM-135M cut to 8 layers (benchmarks/engine_throughput.py, with room for
2,048-token prompts), greedy, EOS ignored. For each server: start it, one small warm-up round, then
for each workload one warm-up round and ``--rounds`` measured rounds with fresh prompts (no
prefix-cache hits), every measured round reported (vLLM's vary more than ours), then stop it. A
workload sends all its requests at once as streamed ``/v1/completions`` with token-id prompts;
output tokens are read from each stream's final usage. Default workloads (issue 40's): 32 requests
x 128 prompt ids and 16 requests x 1,536 prompt ids, each 64 tokens out.

vLLM runs from ``.venv-vllm`` (``make bench-vllm``) as ``python -m vllm.entrypoints.openai.api_server``
with ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV; pdserve gets the same KV memory. Colocated gives its one
engine every torch thread; PD gives P and D half each. pdserve runs in its default mode (batch
invariance per the CPU and dtype: docs/sampling.md); a server named with ``-fastest``
(``colocated-fastest``, ``pd-fastest``) runs with batch invariance off. Prints output tok/s per
round, mean TTFT and the ratio of the rounds' mean to vLLM's.

    python benchmarks/served_vs_vllm.py [--dtype float32|bfloat16] [--threads 2] [--servers vllm,colocated,pd]
    python benchmarks/served_vs_vllm.py --model DIR --workloads 32x128   # a real model's directory
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import json
import os
from pathlib import Path
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import make_model  # noqa: E402
from tests.serving import free_port, serve_session, wait_until  # noqa: E402

MODEL_NAME = "bench"
KV_GIB = 2
START_LIMIT_S = 900


@dataclass(frozen=True)
class Workload:
    requests: int
    input_len: int
    output_len: int = 64

    @property
    def name(self) -> str:
        return f"{self.requests} x {self.input_len} -> {self.output_len}"

    def prompts(self, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, 800) for _ in range(self.input_len)] for _ in range(self.requests)]


async def _one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> tuple[int, float]:
    """(output tokens, seconds to the first token) of one streamed completion."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, (response.status_code, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if first is None and event.get("choices") and event["choices"][0].get("text") is not None:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert tokens == output_len, tokens
    return tokens, first


async def run_round(url: str, prompts: list[list[int]], output_len: int) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, p, output_len) for p in prompts))
        seconds = time.perf_counter() - start
    return {"tok_s": sum(t for t, _ in results) / seconds, "mean_ttft_s": sum(f for _, f in results) / len(results)}


def measure(url: str, workloads: list[Workload], rounds: int) -> dict[str, list[dict]]:
    """Each workload once to warm up, then ``rounds`` measured times, fresh prompts each time: the
    measured rounds."""
    asyncio.run(run_round(url, Workload(4, 64, 8).prompts(0), 8))  # warm-up
    return {w.name: [asyncio.run(run_round(url, w.prompts(100 * i + r), w.output_len)) for r in range(rounds + 1)][1:]
            for i, w in enumerate(workloads, start=1)}


def run_vllm(model_dir: Path, dtype: str, threads: int, workloads: list[Workload], rounds: int,
             venv: Path) -> dict | None:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"vLLM: {python} is missing (make bench-vllm); left out", file=sys.stderr)
        return None
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", MODEL_NAME, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", "256", "--max-model-len", "4096", "--seed", "0"]
    log = Path(tempfile.gettempdir()) / f"vllm-{port}.log"
    with open(log, "w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until(lambda: _healthy(url) or server.poll() is not None, START_LIMIT_S, 2) or server.poll():
            print(f"vLLM did not start; its log:\n{log.read_text()[-3000:]}", file=sys.stderr)
            return None
        return measure(url, workloads, rounds)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def run_pdserve(kind: str, model_dir: Path, dtype: str, threads: int, workloads: list[Workload], rounds: int) -> dict:
    from ray import serve

    from deployments.app import colocated_app, pd_app

    kind, _, mode = kind.partition("-")
    args = {"model": str(model_dir), "served_model_name": MODEL_NAME, "dtype": dtype, "embeddings": False,
            "kv_cache_memory_gb": KV_GIB, "batch_invariant": False if mode == "fastest" else None}
    with serve_session() as url:
        if kind == "colocated":
            app = colocated_app({**args, "torch_threads": threads}, {"ray_actor_options": {"num_cpus": threads}})
        else:
            half = max(1, threads // 2)
            app = pd_app({**args, "torch_threads": half}, {"ray_actor_options": {"num_cpus": half}},
                         {"ray_actor_options": {"num_cpus": half}})
        serve.run(app, name=kind, route_prefix="/")
        assert wait_until(lambda: _healthy(url), START_LIMIT_S, 2), f"pdserve {kind} did not become healthy"
        return measure(url, workloads, rounds)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--servers", default="vllm,colocated,pd")
    parser.add_argument("--workloads", default="32x128,16x1536", help="REQUESTSxPROMPT_LEN,...")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per workload, after a warm-up")
    parser.add_argument("--model", type=Path, help="a model directory to serve instead of the random SmolLM-8L")
    parser.add_argument("--vllm-venv", type=Path, default=Path(__file__).resolve().parents[1] / ".venv-vllm")
    args = parser.parse_args()
    workloads = [Workload(*map(int, w.split("x"))) for w in args.workloads.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_model(Path(tmp) / "smollm-8l", max_position_embeddings=4096)
        for server in args.servers.split(","):
            if server == "vllm":
                measured = run_vllm(model_dir, args.dtype, args.threads, workloads, args.rounds, args.vllm_venv)
            else:
                measured = run_pdserve(server, model_dir, args.dtype, args.threads, workloads, args.rounds)
            if measured is not None:
                results[server] = measured
    print(f"served, {args.dtype}, {args.threads} threads; output tok/s of each round (mean TTFT s of the rounds), "
          "the rounds' mean / vLLM's")
    for w in workloads:
        base = _mean(results["vllm"][w.name], "tok_s") if "vllm" in results else None
        for server, measured in results.items():
            rounds = measured[w.name]
            ratio = f"  {_mean(rounds, 'tok_s') / base:.2f}x" if base and server != "vllm" else ""
            print(f"{w.name:>18}  {server:<18} " + " ".join(f"{r['tok_s']:7.1f}" for r in rounds)
                  + f"  ({_mean(rounds, 'mean_ttft_s'):.2f}){ratio}")
    write_json(args.json, {"dtype": args.dtype, "threads": args.threads, "results": results})


def _mean(rounds: list[dict], key: str) -> float:
    return sum(r[key] for r in rounds) / len(rounds)


if __name__ == "__main__":
    main()
