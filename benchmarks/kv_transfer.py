"""KV movement from P to D through Ray's object store, against the machine's copy bandwidth.

Starts a local 3-node Ray cluster (head, a `prefill` node, a `decode` node), deploys the PD
app with P and D on their own nodes, sends prompts of growing length, and reads D's own
measurements (bytes, seconds per fetch). Also runs P and D on one node, where the fetch is a
zero-copy read of shared memory.

    python benchmarks/kv_transfer.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks.machine import copy_bandwidth  # noqa: E402
from deployments.app import pd_app  # noqa: E402
from tests.serving import serve_session  # noqa: E402

PROMPT_LENGTHS = (256, 1024, 4000)


def measure(url: str, app: str) -> list[dict]:
    handle = serve.get_deployment_handle("DecodeServer", app_name=app)
    rows = []
    for n in PROMPT_LENGTHS:
        before = handle.kv_transfers.remote().result()
        body = {"input_id": [(7 * i) % 800 + 3 for i in range(n)], "parameters": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/{app}/infer_token", json=body, timeout=300).status_code == 200
        after = handle.kv_transfers.remote().result()
        nbytes, seconds = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
        rows.append({"placement": app, "prompt_tokens": n, "kv_mb": nbytes / 1e6, "ms": seconds * 1e3,
                     "gb_s": nbytes / seconds / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2, resources={"prefill": 1})
    cluster.add_node(num_cpus=2, resources={"decode": 2})  # one for each app below
    cluster.wait_for_nodes()
    try:
        with serve_session(address=cluster.address) as url:
            app_args = {"torch_threads": 1}
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
    print(f"{'placement':<12}{'tokens':>8}{'KV MB':>8}{'ms':>9}{'GB/s':>8}{'vs copy':>9}")
    for r in rows:
        r["vs_copy_bandwidth"] = r["gb_s"] * 1e9 / bandwidth
        print(f"{r['placement']:<12}{r['prompt_tokens']:>8}{r['kv_mb']:>8.2f}{r['ms']:>9.2f}{r['gb_s']:>8.2f}"
              f"{r['vs_copy_bandwidth']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"copy_gb_s": bandwidth / 1e9, "transfers": rows}, indent=2))


if __name__ == "__main__":
    main()
