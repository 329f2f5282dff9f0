"""What a Batch API job costs interactive users, and what it gets from idle capacity (issue 44).

One PD app (tiny-llama, float32) on loopback. Interactive traffic: streamed chat requests at a
steady rate (Poisson arrivals, the load tester's client). Four phases, in this order:

1. interactive alone;
2. the batch alone (``--lines`` chat lines through /v1/files and /v1/batches): its lines per second
   on an idle app;
3. interactive again, with the same batch draining beside it: interactive p99 TTFT and TPOT
   against phase 1 (target <= 1.2x, issue 56; the median and p90 too), and the batch's lines per
   second while interactive traffic runs against phase 2 (target >= 50%);
4. a restart mid-batch: the ingress replica SIGKILLed once some lines are done; Serve starts
   another, whose runner takes the batch back from the store; lines lost and answered twice in
   the output file (target 0 and 0).

    python benchmarks/batch_interference.py [--lines 2000] [--rate 2] [--requests 60] [--json PATH]
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
import sys
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from deployments.app import pd_app  # noqa: E402
from tests.serving import deploy, processes, serve_session, sigkill, wait_until  # noqa: E402
from tools.clients import send  # noqa: E402
from tools.loadgen import Work, arrival_gaps  # noqa: E402
from tools.stats import summarize  # noqa: E402

MODEL = "tiny-llama"
KEPT = ("completed", "failed", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
        "p99_tpot_ms")


def batch_lines(count: int, max_tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Item {i}: summarize."}],
                                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}) + "\n"
                   for i in range(count)).encode()


def start_batch(url: str, content: bytes) -> str:
    uploaded = httpx.post(f"{url}/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"},
                          timeout=120)
    uploaded.raise_for_status()
    created = httpx.post(f"{url}/v1/batches", timeout=60, json={"input_file_id": uploaded.json()["id"],
                                                                "endpoint": "/v1/chat/completions",
                                                                "completion_window": "24h"})
    created.raise_for_status()
    return created.json()["id"]


def batch_state(url: str, batch_id: str) -> dict:
    try:
        response = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10)
    except httpx.HTTPError:  # an ingress restarting
        return {}
    return response.json() if response.status_code == 200 else {}


def completed(url: str, batch_id: str) -> int:
    return batch_state(url, batch_id).get("request_counts", {}).get("completed", 0)


def wait_final(url: str, batch_id: str, timeout_s: float) -> dict:
    state: dict = {}

    def final() -> bool:
        state.update(batch_state(url, batch_id))
        return state.get("status") in ("completed", "failed", "cancelled", "expired")

    assert wait_until(final, timeout_s, 0.5), f"batch not done after {timeout_s} s: {state}"
    return state


async def interactive(url: str, rate: float, count: int, output_len: int) -> dict:
    """``count`` streamed chat requests arriving at ``rate`` per second (Poisson); vLLM's fields."""
    works = [Work(i, [], f"Question {i}: tell me about the sea.", output_len, 3) for i in range(count)]
    gaps = arrival_gaps(rate, 1.0, 0)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await send(client, "chat", works[0], MODEL, 120)  # the route warm before the clock starts
        start = time.perf_counter()
        tasks = []
        for work in works:
            tasks.append(asyncio.create_task(send(client, "chat", work, MODEL, 120)))
            await asyncio.sleep(next(gaps))
        results = await asyncio.gather(*tasks)
        summary = summarize(list(results), time.perf_counter() - start)
    return {key: summary[key] for key in KEPT}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--line-tokens", type=int, default=8, help="max_tokens of each batch line")
    parser.add_argument("--rate", type=float, default=2.0, help="interactive requests per second")
    parser.add_argument("--requests", type=int, default=60, help="interactive requests per phase")
    parser.add_argument("--output", type=int, default=32, help="interactive output tokens")
    args = parser.parse_args()
    content = batch_lines(args.lines, args.line_tokens)
    report: dict = {"args": arguments(args)}
    with tempfile.TemporaryDirectory() as store, serve_session() as root:
        deploy({"pd": pd_app({"torch_threads": 1, "dtype": "float32", "embeddings": False, "batch_dir": store})})
        url = f"{root}/pd"
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, 300, 1)

        report["interactive_alone"] = asyncio.run(interactive(url, args.rate, args.requests, args.output))
        print(json.dumps({"phase": "interactive alone", **report["interactive_alone"]}), flush=True)

        began = time.perf_counter()
        alone = wait_final(url, start_batch(url, content), 3600)
        report["batch_alone"] = {"status": alone["status"], "lines": args.lines,
                                 "lines_per_s": args.lines / (time.perf_counter() - began)}
        print(json.dumps({"phase": "batch alone", **report["batch_alone"]}), flush=True)

        batch_id = start_batch(url, content)
        assert wait_until(lambda: completed(url, batch_id) > 0, 300, 0.2)  # draining before the clock starts
        before, began = completed(url, batch_id), time.perf_counter()
        report["interactive_with_batch"] = asyncio.run(interactive(url, args.rate, args.requests, args.output))
        during = completed(url, batch_id) - before
        report["batch_with_interactive"] = {"lines_done": during,
                                            "lines_per_s": during / (time.perf_counter() - began)}
        print(json.dumps({"phase": "interactive with the batch", **report["interactive_with_batch"],
                          "batch_lines_per_s": report["batch_with_interactive"]["lines_per_s"]}), flush=True)
        wait_final(url, batch_id, 3600)

        batch_id = start_batch(url, content)
        assert wait_until(lambda: completed(url, batch_id) >= args.lines // 10, 600, 0.2)
        (ingress,) = processes("Ingress", "pd")
        sigkill(ingress)
        done = wait_final(url, batch_id, 3600)
        output = httpx.get(f"{url}/v1/files/{done['output_file_id']}/content", timeout=120).text.splitlines()
        ids = [json.loads(line)["custom_id"] for line in output]
        report["restart"] = {"status": done["status"], "lines": args.lines, "answered": len(ids),
                             "lost": args.lines - len(set(ids)), "answered_twice": len(ids) - len(set(ids)),
                             "request_counts": done["request_counts"]}
        print(json.dumps({"phase": "restart mid-batch", **report["restart"]}), flush=True)

    alone, shared = report["interactive_alone"], report["interactive_with_batch"]
    # p99 of 60 requests is about their largest: the median and p90 ratios say what one outlier does not.
    report["ratios"] = {f"{stat}_{metric}_with_batch": shared[f"{stat}_{metric}_ms"] / alone[f"{stat}_{metric}_ms"]
                        for metric in ("ttft", "tpot") for stat in ("median", "p90", "p99")}
    report["ratios"]["batch_share_of_idle"] = (report["batch_with_interactive"]["lines_per_s"]
                                               / report["batch_alone"]["lines_per_s"])
    print(json.dumps({"ratios": report["ratios"]}), flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
