"""P-only degradation against colocated and PD: throughput and TTFT while no D replica answers.

Deploys, on loopback, the PD app (1 P, 1 D) and the colocated app (1 engine) of fp32 tiny-llama with
the same engine settings, and sends each the same closed-loop load (``--requests`` streamed
/infer_token requests, ``--concurrency`` at a time, ``--input`` prompt tokens, ``--output``
tokens each): the colocated app; the PD app with its D running; then the PD app with its D
SIGSTOPped, once /health says degraded (P serves every request alone, deployments/pd/decode_watch.py).
Prints one JSON line per run, vLLM's field names (tools/stats.py), and the ratios to colocated.

    python benchmarks/degraded.py [--requests 24] [--concurrency 4] [--input 400] [--output 64] [--json PATH]
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
import random
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from tools.clients import send  # noqa: E402
from tools.loadgen import Work  # noqa: E402
from tools.stats import summarize  # noqa: E402
from deployments.app import colocated_app, pd_app  # noqa: E402
from tests.serving import serve_session, stopped, wait_until  # noqa: E402

ARGS = {"torch_threads": 1, "dtype": "float32", "embeddings": False, "pd_local_prefill_tokens": 0}
KEPT = ("request_throughput", "output_throughput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "completed",
        "failed")


async def closed_loop(url: str, work: list[Work], concurrency: int) -> dict:
    queue = list(work)
    results = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            results.append(await send(client, "infer_token", queue.pop(0), "tiny-llama", 300))

    async with httpx.AsyncClient(base_url=url) as client:
        await send(client, "infer_token", work[0], "tiny-llama", 300)  # warm: the ingress's first call
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    return {key: round(summary[key], 3) if isinstance(summary[key], float) else summary[key] for key in KEPT}


def workload(requests: int, input_len: int, output_len: int) -> list[Work]:
    rng = random.Random(0)
    return [Work(i, [1] + [rng.randrange(5, 885) for _ in range(input_len - 1)], "", output_len, 5)
            for i in range(requests)]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input", type=int, default=400)
    parser.add_argument("--output", type=int, default=64)
    args = parser.parse_args()
    work = workload(args.requests, args.input, args.output)
    runs = {}
    with serve_session() as url:
        serve.run_many([serve.RunTarget(pd_app(ARGS), name="pd", route_prefix="/pd"),
                        serve.RunTarget(colocated_app(ARGS), name="co", route_prefix="/co")])
        for app in ("pd", "co"):
            assert wait_until(lambda: httpx.get(f"{url}/{app}/health", timeout=30).status_code == 200, 300, 1)
        for name, app in (("colocated", "co"), ("pd", "pd")):
            runs[name] = asyncio.run(closed_loop(f"{url}/{app}", work, args.concurrency))
            print(json.dumps({"run": name, **runs[name]}), flush=True)
        with stopped("DecodeServer"):
            stopped_at = time.monotonic()
            assert wait_until(lambda: httpx.get(f"{url}/pd/health", timeout=30).json()["status"] == "degraded", 60,
                              0.1)
            degraded_after = round(time.monotonic() - stopped_at, 2)
            runs["p_only"] = asyncio.run(closed_loop(f"{url}/pd", work, args.concurrency))
            print(json.dumps({"run": "p_only", "degraded_after_s": degraded_after, **runs["p_only"]}), flush=True)
    base = runs["colocated"]
    ratios = {name: {"output_throughput": round(run["output_throughput"] / base["output_throughput"], 3),
                     "median_ttft": round(run["median_ttft_ms"] / base["median_ttft_ms"], 3)}
              for name, run in runs.items()}
    print(json.dumps({"ratios_to_colocated": ratios}))
    write_json(args.json, {"args": arguments(args), "runs": runs, "degraded_after_s": degraded_after, "ratios": ratios})


if __name__ == "__main__":
    main()
