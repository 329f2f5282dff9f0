"""KV movement from P to D through Ray's object store, against the machine's copy bandwidth.

Starts a local 3-node Ray cluster (head, a `prefill` node, a `decode` node), deploys the PD
app with P and D on their own nodes, sends prompts of growing length, and reads D's own
measurements (bytes, seconds per fetch). Also runs P and D on one node, where the fetch is a
zero-copy read of shared memory. Each prompt is streamed, and the client's times of the first
token (P's) and the second (D's first, after the hand-off) are set beside the fetch: the
hand-off is on the path to the second token, not the first.

    python benchmarks/kv_transfer.py [--json PATH] [--chunk-mb MB] [--in-flight-mb MB]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks.clients import send_each  # noqa: E402
from benchmarks.loadgen import Work  # noqa: E402
from benchmarks.machine import copy_bandwidth  # noqa: E402
from deployments.app import pd_app  # noqa: E402
from tests.serving import serve_session  # noqa: E402

PROMPT_LENGTHS = (256, 1024, 4000)


def token_times(url: str, app: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds from sending to the first and to the second streamed token."""
    (result,) = asyncio.run(send_each(f"{url}/{app}", [Work(0, prompt, "", output_len=2, priority=5)], timeout=300))
    assert result.ok, result.error
    return result.ttft, result.ttft + result.itl[0]


def measure(url: str, app: str) -> list[dict]:
    handle = serve.get_deployment_handle("DecodeServer", app_name=app)
    rows = []
    for n in PROMPT_LENGTHS:
        before = handle.kv_transfers.remote().result()
        first, second = token_times(url, app, [(7 * i + n) % 800 + 3 for i in range(n)])
        after = handle.kv_transfers.remote().result()
        nbytes, seconds = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
        rows.append({"placement": app, "prompt_tokens": n, "kv_mb": nbytes / 1e6, "ms": seconds * 1e3,
                     "gb_s": nbytes / seconds / 1e9, "ttft_ms": first * 1e3, "second_token_ms": second * 1e3})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
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
    cluster.add_node(num_cpus=2, resources={"prefill": 1})
    cluster.add_node(num_cpus=2, resources={"decode": 2})  # one for each app below
    cluster.wait_for_nodes()
    try:
        with serve_session(address=cluster.address) as url:
            app_args = {"torch_threads": 1, "pd_local_prefill_tokens": 0}
            apart = pd_app(app_args, {"ray_actor_options": {"num_cpus": 1, "resources": {"prefill": 1}}},
                                 {"ray_actor_options": {"num_cpus": 1, "resources": {"decode": 1}}})
            together = pd_app(app_args, {"ray_actor_options": {"num_cpus": 0.5, "resources": {"decode": 0.1}}},
                                    {"ray_actor_options": {"num_cpus": 0.5, "resources": {"decode": 0.1}}})
            serve.run(apart, name="cross_node", route_prefix="/cross_node")
            serve.run(together, name="same_node", route_prefix="/same_node")
            rows = measure(url, "cross_node") + measure(url, "same_node")
    finally:
        cluster.shutdown()
    print(f"memory copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    print(f"{'placement':<12}{'tokens':>8}{'KV MB':>8}{'ms':>9}{'GB/s':>8}{'vs copy':>9}{'TTFT ms':>9}"
          f"{'2nd ms':>9}{'fetch/TTFT':>11}")
    for r in rows:
        r["vs_copy_bandwidth"] = r["gb_s"] * 1e9 / bandwidth
        print(f"{r['placement']:<12}{r['prompt_tokens']:>8}{r['kv_mb']:>8.2f}{r['ms']:>9.2f}{r['gb_s']:>8.2f}"
              f"{r['vs_copy_bandwidth']:>9.2f}{r['ttft_ms']:>9.1f}{r['second_token_ms']:>9.1f}"
              f"{r['ms'] / r['ttft_ms']:>11.3f}")
    if args.json:
        args.json.write_text(json.dumps({"copy_gb_s": bandwidth / 1e9, "transfers": rows}, indent=2))


if __name__ == "__main__":
    main()
