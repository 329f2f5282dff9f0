"""Ray's GCS fault tolerance with an external Redis (docs/operations.md, cluster.yaml): the head
node's control store (the GCS server) is killed mid-load and started again; the PD app keeps
answering while it is down, and Serve's control plane works again once it is back.

A real Redis (Debian's redis-server, installed by `make test`) on loopback, and a real local Ray
cluster (a head and a worker node) whose head keeps the GCS tables in it. The fault is proven (the
GCS process is gone, and nothing answers on its port) and the kill matrix's invariants are checked:
every request sent during and after the fault completes with the fault-free greedy tokens, and P and
D hold nothing afterwards."""

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid

import httpx
import psutil
import pytest
from ray import serve
from ray.cluster_utils import Cluster

from deployments.app import pd_app
from tests.serving import assert_nothing_held, deploy, free_port, serve_session, sse_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]

REQUESTS_WHILE_DOWN = 4  # each a 16-token greedy answer: a few seconds in all, well inside Ray's
# gcs_rpc_server_reconnect_timeout_s (60 s by default), after which raylets give a lost GCS up


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="module")
def redis_address():
    """A Redis on a free loopback port, in memory only, stopped after the module."""
    server = shutil.which("redis-server")
    assert server, "redis-server is missing: `make test` installs Debian's redis-server"
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", workdir],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_until(lambda: answers_ping(port), 30), "redis-server did not answer PING"
            yield f"127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(30)


@contextlib.contextmanager
def environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def cluster(redis_address):
    """A head keeping its GCS tables in Redis (what cluster.yaml's head_start_ray_commands set), and
    a worker node. RAY_REDIS_ADDRESS is read when each node starts, the GCS server's restart included."""
    with environment(RAY_REDIS_ADDRESS=redis_address, RAY_external_storage_namespace=f"pdserve-{uuid.uuid4().hex}"):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        try:
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            cluster.shutdown()


@pytest.fixture(scope="module")
def url(cluster):
    with serve_session(address=cluster.address) as url:
        deploy({"pd": pd_app({"torch_threads": 1, "dtype": "float32", "embeddings": False,
                              "pd_local_prefill_tokens": 0})})
        yield f"{url}/pd"


def body(i: int, stream: bool = False) -> dict:
    return {"input_id": [1, 40 + i, 41 + i, 42 + i, 43 + i], "stream": stream,
            "parameters": {"max_new_tokens": 16, "ignore_eos": True, "do_sample": False}}


def answer_text(url: str, i: int, stream: bool = False) -> str:
    """The request's whole text; fails unless it completed (200, and for a stream its last event)."""
    if not stream:
        response = httpx.post(f"{url}/infer_token", json=body(i), timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["generated_text"]
    response = httpx.post(f"{url}/infer_token", json=body(i, stream=True), timeout=60)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1]["generated_text"] is not None and "err_msg" not in events[-1].get("details", {}), events[-1]
    return events[-1]["generated_text"]


def gcs_processes(cluster: Cluster) -> list[psutil.Process]:
    head = cluster.head_node
    return [psutil.Process(info.process.pid) for info in head.all_processes.get("gcs_server", [])]


def test_serve_answers_while_the_gcs_is_down_and_recovers_when_it_is_back(cluster, url):
    references = {i: answer_text(url, i) for i in range(REQUESTS_WHILE_DOWN)}
    gcs_port = int(cluster.address.rsplit(":", 1)[1])
    (gcs,) = gcs_processes(cluster)
    cluster.head_node.kill_gcs_server()
    try:
        assert not gcs.is_running() or gcs.status() == psutil.STATUS_ZOMBIE  # the fault happened
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", gcs_port), timeout=1).close()
        # The data plane (proxy, ingress, P, D, the KV hand-off) needs no GCS: same answers, streamed too.
        during = {i: answer_text(url, i, stream=i % 2 == 1) for i in range(REQUESTS_WHILE_DOWN)}
    finally:
        cluster.head_node.start_gcs_server()
    assert during == references
    # Once back, Serve's control plane answers (the controller reconnected and read its state back
    # from Redis) and new requests go on.
    assert wait_until(lambda: serve.status().applications["pd"].status == "RUNNING", 120, 1)
    assert {i: answer_text(url, i) for i in range(REQUESTS_WHILE_DOWN)} == references
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd")
