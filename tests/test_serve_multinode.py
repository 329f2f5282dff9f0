"""P and D on separate nodes of a real (single-machine) Ray cluster: the KV crosses raylets, through
Ray's object store (app ``pd``) and through shared memory (app ``pd_shm``, deployments/pd/kv_direct.py)."""

import asyncio
import gc

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from deployments.app import colocated_app, pd_app
from deployments.pd.backends import PDBackend
from deployments.config import AppArgs
from deployments.pd.kv_connector import make_kv_connector
from deployments.pd.kv_direct import segments
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.serving import deploy, element_size, processes, serve_session, sigkill, sse_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    # One P and one D per PD app, and a CPU to spare on each role's node: Serve spreads replicas, so
    # the colocated engine may land there too, and must not take a CPU a P or D was placed for.
    nodes = {"prefill": cluster.add_node(num_cpus=3, resources={"prefill": 2}),
             "decode": cluster.add_node(num_cpus=3, resources={"decode": 2})}
    cluster.wait_for_nodes()
    yield cluster, {role: node.node_id for role, node in nodes.items()}
    cluster.shutdown()


@pytest.fixture(scope="module")
def url(cluster):
    cluster, _ = cluster
    before = set(segments())  # another process of this host may hold segments of its own
    with serve_session(address=cluster.address) as url:
        # float32: the three apps' greedy tokens are compared exactly.
        args = {"torch_threads": 1, "pd_local_prefill_tokens": 0, "dtype": "float32", "embeddings": False}
        placed = {"prefill_options": {"ray_actor_options": {"num_cpus": 1, "resources": {"prefill": 1}}},
                  "decode_options": {"ray_actor_options": {"num_cpus": 1, "resources": {"decode": 1}}}}
        deploy({"pd": pd_app(args, **placed), "pd_shm": pd_app({**args, "kv_transport": "shared_memory"}, **placed),
                "co": colocated_app(args)})
        yield url
    # Every hand-off of the module ended its segment: D unlinked it, or the ingress's lease did.
    gc.collect()  # this process was the ingress of the fault test's requests
    assert wait_until(lambda: not set(segments()) - before, 30), set(segments()) - before


@pytest.mark.parametrize("app", ["pd", "pd_shm"])
def test_p_and_d_on_their_nodes_and_output_matches_colocated(cluster, url, app):
    _, node_ids = cluster
    p_info = serve.get_deployment_handle("PrefillServer", app_name=app).info.remote().result()
    d_info = serve.get_deployment_handle("DecodeServer", app_name=app).info.remote().result()
    assert p_info.node_id == node_ids["prefill"]
    assert d_info.node_id == node_ids["decode"]
    assert p_info.node_id != d_info.node_id

    body = {"input_id": list(range(20, 80)), "stream": True,
            "parameters": {"max_new_tokens": 16, "do_sample": False, "ignore_eos": True}}
    tokens = {}
    for name in (app, "co"):
        response = httpx.post(f"{url}/{name}/infer_token", json=body, timeout=120)
        assert response.status_code == 200
        tokens[name] = [e["token"]["id"] for e in sse_events(response)]
    assert tokens[app] == tokens["co"] and len(tokens[app]) == 16
    transfers = serve.get_deployment_handle("DecodeServer", app_name=app).kv_transfers.remote().result()
    assert transfers["count"] == 1 and transfers["bytes"] == 4 * 2 * 60 * 4 * 32 * element_size(d_info.dtype)
    assert len(ray.nodes()) == 3


def test_prefill_killed_after_its_reply_d_still_reads_the_shared_memory_kv(url):
    """tests/test_faults.py's P-killed test on the shared-memory transport, across raylets: P
    answers, its process is SIGKILLed and gone, then D on the other raylet maps P's segment."""
    # A stall bound of 30 s: the claim is D's read of a dead P's KV, not the stall watch (test_stalls); a
    # full run starves this 3-node cluster's D for > 5 s at times, which the default took for a stall.
    args = AppArgs(kv_transport="shared_memory", stall_timeout_s=30)
    backend = PDBackend(serve.get_deployment_handle("PrefillServer", "pd_shm"),
                        serve.get_deployment_handle("DecodeServer", "pd_shm"), args.kv_lease_s,
                        args.stall_timeout_s, args.disaggregation, make_kv_connector(args.kv_transport))
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    prompt = [1] + [(7 * i) % 800 + 3 for i in range(600)]

    async def fault_free() -> list[int]:
        outputs = [o async for batch in backend.stream(GenerationRequest("p-alive", prompt, params)) for o in batch]
        return [t for o in outputs for t in o.new_token_ids]

    async def prefill_kill_decode() -> list[int]:
        request = GenerationRequest("p-killed", prompt, params)
        reply = await backend.prefill_step(request)
        (prefill,) = processes("PrefillServer", "pd_shm")
        sigkill(prefill)  # the fault happened: P is gone, its KV not read yet
        assert len(segments()) == 1  # P's segment, claimed by this process (the ingress here)
        outputs = [o async for batch in backend.decode_step(request, reply) for o in batch]
        return reply.outputs[0].new_token_ids + [t for o in outputs for t in o.new_token_ids]

    async def both() -> tuple[list[int], list[int]]:
        # One event loop, as in the ingress (tests/test_faults.py's P-killed test says why).
        return await fault_free(), await prefill_kill_decode()

    expected, tokens = asyncio.run(both())  # D read the KV of a dead P: no error, no prefill again
    assert len(tokens) == 32 and tokens == expected
