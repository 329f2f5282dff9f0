"""KV movement from P to D by each KV transport (Ray's object store, shared memory), against the
machine's copy bandwidth.

Starts a local 3-node Ray cluster (head, a `prefill` node, a `decode` node), deploys for each
transport a PD app with P and D on their own nodes and one with both on one node, sends prompts
of growing length to each app in turn (the transports interleaved, ``--repeats`` rounds: medians),
and reads D's own measurements (bytes, seconds per fetch). Each prompt is streamed, and the
client's times of the first token (P's) and the second (D's first, after the hand-off) are set
beside the fetch: the hand-off is on the path to the second token, not the first. Then the
shared-memory hand-off's steps, timed in this process (P's write, D's map, D's copy into blocks).

    python benchmarks/kv_transfer.py [--transport object_store shared_memory] [--repeats 3] [--json PATH]
                                     [--chunk-mb MB] [--in-flight-mb MB]
"""

from __future__ import annotations

import asyncio
from pathlib import Path
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.machine import copy_bandwidth  # noqa: E402
from deployments.app import pd_app  # noqa: E402
from deployments.pd.kv_connector import KV_TRANSPORTS  # noqa: E402
from deployments.pd.kv_direct import map_segment, write_segment  # noqa: E402
from tests.serving import deploy, serve_session  # noqa: E402
from tools.clients import send_each  # noqa: E402
from tools.loadgen import Work  # noqa: E402

PROMPT_LENGTHS = (256, 1024, 4000)


def token_times(url: str, app: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds from sending to the first and to the second streamed token."""
    (result,) = asyncio.run(send_each(f"{url}/{app}", [Work(0, prompt, "", output_len=2, priority=5)], timeout=300))
    assert result.ok, result.error
    return result.ttft, result.ttft + result.itl[0]


def measure(url: str, app: str, placement: str, transport: str, round_: int) -> list[dict]:
    handle = serve.get_deployment_handle("DecodeServer", app_name=app)
    rows = []
    for n in PROMPT_LENGTHS:
        before = handle.kv_transfers.remote().result()
        # Each round its own prompt: no prefix cache hit on P.
        first, second = token_times(url, app, [(7 * i + n + 131 * round_) % 800 + 3 for i in range(n)])
        after = handle.kv_transfers.remote().result()
        nbytes, seconds = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
        rows.append({"placement": placement, "transport": transport, "prompt_tokens": n, "kv_mb": nbytes / 1e6,
                     "ms": seconds * 1e3, "ttft_ms": first * 1e3, "second_token_ms": second * 1e3})
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (placement, transport, prompt length): the median of each time over the rounds
    (and the fastest fetch), in the order first seen."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["placement"], r["transport"], r["prompt_tokens"]), []).append(r)
    out = []
    for (placement, transport, n), group in groups.items():
        ms = statistics.median(r["ms"] for r in group)
        ttft = statistics.median(r["ttft_ms"] for r in group)
        gap = statistics.median(r["second_token_ms"] - r["ttft_ms"] for r in group)
        kv_mb = group[0]["kv_mb"]
        out.append({"placement": placement, "transport": transport, "prompt_tokens": n, "rounds": len(group),
                    "kv_mb": kv_mb, "ms": ms, "min_ms": min(r["ms"] for r in group), "gb_s": kv_mb / ms,
                    "ttft_ms": ttft, "second_token_gap_ms": gap, "fetch_over_ttft": ms / ttft})
    return out


def shared_memory_steps(megabytes: float = 16.0, repeats: int = 20) -> dict[str, float]:
    """The shared-memory hand-off's steps on ``megabytes`` of KV, best of ``repeats`` (ms): P's
    write into /dev/shm, D's map (page tables filled) and unlink, D's copy of the mapped bytes
    into its own memory (what ``receive_kv`` does into its blocks)."""
    data = np.random.default_rng(0).standard_normal(int(megabytes * 1e6 / 4), dtype=np.float32)
    blocks = np.empty_like(data)
    best = {"write_ms": float("inf"), "map_ms": float("inf"), "copy_ms": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        segment = write_segment(data)
        t1 = time.perf_counter()
        mapped = map_segment(segment)
        t2 = time.perf_counter()
        np.copyto(blocks, mapped)
        t3 = time.perf_counter()
        del mapped
        for key, seconds in zip(best, (t1 - t0, t2 - t1, t3 - t2)):
            best[key] = min(best[key], seconds * 1e3)
    return {"mb": data.nbytes / 1e6, **best}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--transport", nargs="+", choices=KV_TRANSPORTS, default=list(KV_TRANSPORTS),
                        help="the KV transports compared, each in its own pair of apps (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every app; medians are reported")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (the KV's)")
    parser.add_argument("--chunk-mb", type=float, help="Ray's object_manager_default_chunk_size (default 5 MiB)")
    parser.add_argument("--in-flight-mb", type=float, help="Ray's object_manager_max_bytes_in_flight")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    system = {}
    if args.chunk_mb:
        system["object_manager_default_chunk_size"] = int(args.chunk_mb * 2**20)
    if args.in_flight_mb:
        system["object_manager_max_bytes_in_flight"] = int(args.in_flight_mb * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": system})
    # Logical CPUs: every node is this machine's cores. Per transport, P of the cross-node app on
    # `prefill`; its D and the same-node app's P and D on `decode`.
    count = len(args.transport)
    cluster.add_node(num_cpus=2 * count, resources={"prefill": count})
    cluster.add_node(num_cpus=2 * count, resources={"decode": 2 * count})
    cluster.wait_for_nodes()
    apps = {}  # name -> (placement, transport)
    try:
        with serve_session(address=cluster.address) as url:
            builds = {}
            for transport in args.transport:
                app_args = {"torch_threads": 1, "pd_local_prefill_tokens": 0, "embeddings": False,
                            "dtype": args.dtype, "kv_transport": transport}
                builds[f"cross_node_{transport}"] = pd_app(
                    app_args, {"ray_actor_options": {"num_cpus": 1, "resources": {"prefill": 1}}},
                    {"ray_actor_options": {"num_cpus": 1, "resources": {"decode": 1}}})
                builds[f"same_node_{transport}"] = pd_app(
                    app_args, {"ray_actor_options": {"num_cpus": 0.5, "resources": {"decode": 0.5}}},
                    {"ray_actor_options": {"num_cpus": 0.5, "resources": {"decode": 0.5}}})
                apps[f"cross_node_{transport}"] = ("different nodes", transport)
                apps[f"same_node_{transport}"] = ("same node", transport)
            deploy(builds)
            for name in apps:  # a warm-up request per app: first calls pay imports and connections
                token_times(url, name, list(range(3, 67)))
            rows = [row for round_ in range(args.repeats) for name, (placement, transport) in apps.items()
                    for row in measure(url, name, placement, transport, round_)]
    finally:
        cluster.shutdown()
    table = sorted(medians(rows), key=lambda r: (r["placement"], r["prompt_tokens"], r["transport"]))
    steps = shared_memory_steps()
    print(f"memory copy bandwidth: {bandwidth / 1e9:.1f} GB/s; {args.repeats} rounds, medians")
    print(f"{'placement':<16}{'transport':<15}{'tokens':>7}{'KV MB':>8}{'ms':>8}{'min ms':>8}{'GB/s':>7}"
          f"{'TTFT ms':>9}{'2nd-1st':>9}{'fetch/TTFT':>11}")
    for r in table:
        print(f"{r['placement']:<16}{r['transport']:<15}{r['prompt_tokens']:>7}{r['kv_mb']:>8.2f}{r['ms']:>8.2f}"
              f"{r['min_ms']:>8.2f}{r['gb_s']:>7.2f}{r['ttft_ms']:>9.1f}{r['second_token_gap_ms']:>9.1f}"
              f"{r['fetch_over_ttft']:>11.3f}")
    print("shared memory, in this process, {mb:.1f} MB, best of 20: P's write {write_ms:.2f} ms, D's map "
          "{map_ms:.2f} ms, D's copy into its blocks {copy_ms:.2f} ms".format(**steps))
    write_json(args.json, {"copy_gb_s": bandwidth / 1e9, "medians": table, "transfers": rows,
                           "shared_memory_steps": steps})


if __name__ == "__main__":
    main()
