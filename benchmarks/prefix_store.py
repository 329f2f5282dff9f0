"""The prefix store (issue 54 item 2) on a replayed multi-turn trace: hit rate and TTFT.

Writes a multi-turn trace with tools/make_trace.py (``--sessions`` conversations of ``--turns``
turns, each turn the previous prompt, its answer and a new user message of ``--user-tokens``, over a
``--system-tokens`` system prompt shared by all; ids per ``--block-size`` tokens), then replays it
(``pdserve-loadtest --trace``, at ``--speedup``) against three PD apps of fp32 ``--model``, one
after the other, each with the same engine settings and D neither holding nor computing prompts
(every prompt token is P's to compute or find):

- ``isolated``: 2 P replicas routed by load alone (``pd_prefill_affinity`` off: a conversation's
  turns spread over both), each with its own prefix cache;
- ``store``: the same, with the app's prefix store on (``prefix_store_mib``);
- ``shared``: 1 P replica: a single shared cache, the store's oracle.

Prints per app P's prefix hit rate over the replay (tokens found in its pool, imported blocks
included, over tokens looked up), the prompt tokens P computed, TTFT p50/p90, and the store's
counters; then the store's hit rate over the shared cache's and the isolated TTFT p50 over the
store's (issue 54's targets: >= 0.9 and >= 3).

    python benchmarks/prefix_store.py [--sessions 8] [--turns 10] [--system-tokens 256]
        [--user-tokens 100:200] [--block-size 64] [--speedup 1] [--model tiny-llama] [--json PATH]

A long system prompt shared by every session is in every P's pool after a few requests, so it
hides what the store adds: the defaults keep it short, and each conversation's own history is most
of its prompts (the trace's block reuse is printed, and kept in the results).
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import sys
import tempfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from deployments.app import pd_app  # noqa: E402
from tests.serving import serve_session, wait_until  # noqa: E402
from tools import loadtest, make_trace  # noqa: E402

ARGS = {"torch_threads": 1, "dtype": "float32", "embeddings": False, "pd_local_prefill_tokens": 0,
        "pd_decode_prefix_reuse": False}
APPS = {  # name -> (app arguments, P replicas)
    "isolated": ({"pd_prefill_affinity": False}, 2),
    "store": ({"pd_prefill_affinity": False, "prefix_store_mib": 512}, 2),
    "shared": ({}, 1),
}


def p_counters(url: str) -> dict[str, float]:
    """P's prefix-cache and prompt counters, and the store's, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {}
    for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed"):
        match = re.search(rf'^pdserve_{name}{{deployment="PrefillServer"}} (\S+)$', text, re.MULTILINE)
        found[name] = float(match.group(1)) if match else 0.0
    for event, value in re.findall(r'^pdserve_prefix_store_(?:blocks|calls)\{event="(\w+)"\} (\S+)$', text,
                                   re.MULTILINE):
        found[f"store_{event}"] = float(value)
    return found


def replay(url: str, trace: Path, block_size: int, speedup: float) -> dict:
    before = p_counters(url)
    result = loadtest.main(["--base-url", url, "--endpoint", "infer_token", "--trace", str(trace),
                            "--block-size", str(block_size), "--speedup", str(speedup), "--quiet"])
    after = p_counters(url)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    queries = delta["prefix_cache_queries"]
    return {"p_prefix_hit_rate": round(delta["prefix_cache_hits"] / queries, 4) if queries else 0.0,
            "p_prompt_tokens_computed": int(delta["prompt_tokens_computed"]),
            "median_ttft_ms": round(result["median_ttft_ms"], 1), "p90_ttft_ms": round(result["p90_ttft_ms"], 1),
            "completed": result["completed"], "failed": result.get("failed", 0),
            "trace_block_reuse": result["trace"]["block_reuse"],
            **{name: int(value) for name, value in delta.items() if name.startswith("store_")}}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", default="100:200")
    parser.add_argument("--block-size", type=int, default=64, help="trace tokens per hash id")
    parser.add_argument("--speedup", type=float, default=1.0)
    parser.add_argument("--model", default="tiny-llama", help="the apps' model (a GGUF file, a directory)")
    args = parser.parse_args()
    trace = Path(tempfile.mkdtemp()) / "multi_turn.jsonl"
    make_trace.main(["--mode", "multi-turn", "--sessions", str(args.sessions), "--turns", str(args.turns),
                     "--system-tokens", str(args.system_tokens), "--user-tokens", args.user_tokens,
                     "--block-size", str(args.block_size), "--out", str(trace)])
    runs = {}
    with serve_session() as url:
        for name, (app_args, p_replicas) in APPS.items():
            serve.run(pd_app({**ARGS, **app_args, "model": args.model}, prefill_options={"num_replicas": p_replicas}),
                      name=name, route_prefix=f"/{name}")
            assert wait_until(lambda: httpx.get(f"{url}/{name}/health", timeout=30).status_code == 200, 300, 1)
            runs[name] = replay(f"{url}/{name}", trace, args.block_size, args.speedup)
            print(json.dumps({"app": name, **runs[name]}), flush=True)
            serve.delete(name)
    ratios = {"store_hit_rate_over_shared": round(runs["store"]["p_prefix_hit_rate"]
                                                  / runs["shared"]["p_prefix_hit_rate"], 3),
              "isolated_ttft_p50_over_store": round(runs["isolated"]["median_ttft_ms"]
                                                    / runs["store"]["median_ttft_ms"], 3)}
    print(json.dumps(ratios))
    write_json(args.json, {"args": arguments(args), "runs": runs, "ratios": ratios})


if __name__ == "__main__":
    main()
