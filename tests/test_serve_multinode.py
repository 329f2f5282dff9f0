"""P and D on separate nodes of a real (single-machine) Ray cluster: the KV crosses object stores."""

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from deployments.app import colocated_app, pd_app
from tests.serving import element_size, serve_session, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = {"prefill": cluster.add_node(num_cpus=2, resources={"prefill": 1}),
             "decode": cluster.add_node(num_cpus=2, resources={"decode": 1})}
    cluster.wait_for_nodes()
    yield cluster, {role: node.node_id for role, node in nodes.items()}
    cluster.shutdown()


def test_p_and_d_on_their_nodes_and_output_matches_colocated(cluster):
    cluster, node_ids = cluster
    with serve_session(address=cluster.address) as url:
        args = {"torch_threads": 1, "pd_local_prefill_tokens": 0}
        serve.run(pd_app(args, prefill_options={"ray_actor_options": {"num_cpus": 1, "resources": {"prefill": 1}}},
                               decode_options={"ray_actor_options": {"num_cpus": 1, "resources": {"decode": 1}}}),
                  name="pd", route_prefix="/pd")
        serve.run(colocated_app(args), name="co", route_prefix="/co")
        p_info = serve.get_deployment_handle("PrefillServer", app_name="pd").info.remote().result()
        d_info = serve.get_deployment_handle("DecodeServer", app_name="pd").info.remote().result()
        assert p_info.node_id == node_ids["prefill"]
        assert d_info.node_id == node_ids["decode"]
        assert p_info.node_id != d_info.node_id

        body = {"input_id": list(range(20, 80)), "stream": True,
                "parameters": {"max_new_tokens": 16, "do_sample": False, "ignore_eos": True}}
        tokens = {}
        for app in ("pd", "co"):
            response = httpx.post(f"{url}/{app}/infer_token", json=body, timeout=120)
            assert response.status_code == 200
            tokens[app] = [e["token"]["id"] for e in sse_events(response)]
        assert tokens["pd"] == tokens["co"] and len(tokens["pd"]) == 16
        transfers = serve.get_deployment_handle("DecodeServer", app_name="pd").kv_transfers.remote().result()
        assert transfers["count"] == 1 and transfers["bytes"] == 4 * 2 * 60 * 4 * 32 * element_size(d_info.dtype)
        assert len(ray.nodes()) == 3
