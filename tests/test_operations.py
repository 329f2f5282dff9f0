"""What an operator relies on: placement on a 2-CPU cluster, a /health that proves a P->D round
trip and names what is wrong, bounded waits, one request id across ingress, P and D, phase
histograms counted once per request, one log line per request, spans."""

import glob
import json
import os
import re

import httpx
import pytest
from ray import serve

from deployments.app import pd_app
from deployments.config import AppArgs
from deployments.ingress.ingress import Ingress
from deployments.replicas.servers import DecodeServer, PrefillServer
from tests.serving import deploy, serve_session, wait_until

pytestmark = pytest.mark.own_ray  # a 2-CPU Ray of its own: placement is what it tests

PHASES = ["pdserve_time_to_first_token_seconds", "pdserve_request_prefill_time_seconds",
          "pdserve_request_decode_time_seconds", "pdserve_kv_transfer_seconds", "pdserve_kv_transfer_bytes",
          "pdserve_e2e_request_latency_seconds", 'pdserve_request_queue_time_seconds{stage="ingress"}',
          'pdserve_request_queue_time_seconds{stage="prefill"}', 'pdserve_request_queue_time_seconds{stage="decode"}']


def custom_pd(args: dict, decode_config: dict, decode_cpus: float):
    """A PD app whose D has its own engine settings and CPU request; P and the ingress take no CPU."""
    args = AppArgs.model_validate(args)
    prefill = PrefillServer.options(ray_actor_options={"num_cpus": 0})
    prefill = prefill.bind(args.engine_config(), None, args.max_loras, args.heartbeat_s, args.step_timeout_s)
    decode_args = args.model_copy(update=decode_config)
    decode = DecodeServer.options(ray_actor_options={"num_cpus": decode_cpus})
    decode = decode.bind(decode_args.engine_config(), None, args.max_loras, decode_args.heartbeat_s,
                         args.step_timeout_s, args.kv_lease_s)
    return Ingress.bind(args, prefill=prefill, decode=decode)


@pytest.fixture(scope="module")
def base_url():
    # Serve names an unplaceable replica's resources after 1 s (30 s by default).
    os.environ.update(RAY_SERVE_SLOW_STARTUP_WARNING_S="1", RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S="1")
    try:
        with serve_session(num_cpus=2) as url:
            # The default PD app (P and D: one CPU each) and the embedder, on 2 CPUs: it must place.
            pd = pd_app({"torch_threads": 1, "traces_exporter": "console", "pd_local_prefill_tokens": 0})
            # D cannot hold the canary's 32-token prompt: one KV block of 16 tokens.
            smalld = custom_pd({"torch_threads": 1, "embeddings": False, "pd_local_prefill_tokens": 0},
                               {"num_blocks": 1}, 0)
            deploy({"pd": pd, "smalld": smalld})  # together: smalld takes no CPU, pd's placement is the same
            # D asks for more CPUs than the cluster has: never placed.
            serve._run(custom_pd({"torch_threads": 1, "embeddings": False}, {}, 8), name="unplaced",
                       route_prefix="/unplaced", _blocking=False)
            yield url
    finally:
        for name in ("RAY_SERVE_SLOW_STARTUP_WARNING_S", "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S"):
            del os.environ[name]


def session_logs() -> str:
    """This module's Ray's log folder (not /tmp/ray/session_latest: a Ray started after this one,
    on the other xdist worker, takes that link)."""
    import ray

    return os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")


def serve_logs(pattern: str = "*.log") -> str:
    return "".join(open(f, errors="replace").read() for f in glob.glob(f"{session_logs()}/serve/{pattern}"))


def worker_output() -> str:
    return "".join(open(f, errors="replace").read() for f in glob.glob(f"{session_logs()}/worker-*.out"))


def histogram_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/pd/metrics", timeout=30).text
    counts = {}
    for name in PHASES:
        base, _, labels = name.partition("{")
        match = re.search(rf"^{re.escape(base)}_count{re.escape('{' + labels if labels else '')} (\S+)$", text, re.M)
        counts[name] = float(match.group(1)) if match else 0.0
    return counts


def test_pd_app_places_on_two_cpus_and_is_ready(base_url):
    body = httpx.get(f"{base_url}/pd/health", timeout=30).json()
    assert body["status"] == "ok"
    embedding = httpx.post(f"{base_url}/pd/v1/embeddings", json={"input": "a sentence"}, timeout=60)
    assert embedding.status_code == 200 and len(embedding.json()["data"][0]["embedding"]) == 384


def test_health_fails_when_d_cannot_load_the_kv(base_url):
    response = httpx.get(f"{base_url}/smalld/health", timeout=30)
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["canary"]["deployment"] == "DecodeServer" and "ValueError" in body["canary"]["reason"]
    assert body["deployments"]["DecodeServer"]["status"] == "failing"
    assert body["deployments"]["PrefillServer"] == {"status": "healthy"}
    assert "pid" not in response.text and "Traceback" not in response.text
    # A short prompt still goes through (D holds 16 tokens): the canary, not D's liveness, failed.
    served = httpx.post(f"{base_url}/smalld/infer_token", json={"input_id": [5, 6], "parameters": {
        "max_new_tokens": 3, "ignore_eos": True, "details": True}}, timeout=30)
    assert served.json()["details"]["generated_tokens"] == 3


def test_health_names_a_deployment_that_cannot_be_placed(base_url):
    def named():
        try:
            response = httpx.get(f"{base_url}/unplaced/health", timeout=30)
        except httpx.TimeoutException:  # the loaded box (a full run: another worker's deploys): not yet
            return False
        state = response.json()["deployments"]["DecodeServer"]
        return response.status_code == 503 and state["status"] == "pending" and '"CPU": 8' in state["reason"]

    assert wait_until(named, 120, interval_s=1)
    logs = serve_logs("replica_unplaced_Ingress_*.log")
    assert "DecodeServer is pending" in logs and '"CPU": 8' in logs  # said at start-up, too


@pytest.mark.parametrize("path", ["/v1/models", "/infer_token", "/v1/chat/completions"])
def test_a_missing_engine_is_a_503_not_a_hang(base_url, path):
    body = ({"input_id": [5, 6]} if path == "/infer_token" else
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
    response = (httpx.get(f"{base_url}/unplaced{path}", timeout=30) if path == "/v1/models" else
                httpx.post(f"{base_url}/unplaced{path}", json=body, timeout=30))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "not_ready"


def test_request_id_is_returned_and_logged_on_ingress_p_and_d(base_url):
    request_id = "trace-4f1c9a"
    response = httpx.post(f"{base_url}/pd/infer_token", headers={"x-request-id": request_id},
                          json={"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 4, "ignore_eos": True}},
                          timeout=30)
    assert response.status_code == 200 and response.headers["x-request-id"] == request_id
    made = httpx.post(f"{base_url}/pd/infer_token", json={"input_id": [5, 6]}, timeout=30).headers["x-request-id"]
    assert made and made != request_id

    def logged_everywhere():
        return all(request_id in serve_logs(f"replica_pd_{d}_*.log")
                   for d in ("Ingress", "PrefillServer", "DecodeServer"))

    assert wait_until(logged_everywhere, 30)
    line = next(x for x in serve_logs("replica_pd_Ingress_*.log").splitlines() if f"request {request_id} (" in x)
    for part in ("mindie: finished", "priority=5", "prompt_tokens=3", "output_tokens=4", "finish=length",
                 "prefill=", "kv_transfer=", "queue_decode=", "kv_bytes="):
        assert part in line, (part, line)


def test_logs_carry_no_prompt_or_text(base_url):
    secret = "zebra-prompt-marker"
    response = httpx.post(f"{base_url}/pd/v1/chat/completions", headers={"x-request-id": "chat-no-payload"},
                          json={"model": "tiny-llama", "messages": [{"role": "user", "content": secret}],
                                "max_tokens": 24, "ignore_eos": True, "seed": 5}, timeout=30)
    assert response.status_code == 200
    assert wait_until(lambda: "request chat-no-payload (" in serve_logs(), 30)
    text = response.json()["choices"][0]["message"]["content"]
    # 24 tokens of a random model: long enough that no log holds it by chance, for any seed's text.
    assert len(text) >= 16, text
    logs = serve_logs() + worker_output()
    assert secret not in logs and text not in logs


def test_phase_histograms_count_each_request_once(base_url):
    before = histogram_counts(base_url)
    response = httpx.post(f"{base_url}/pd/infer_token", json={"input_id": [5, 6, 7], "parameters": {
        "max_new_tokens": 5, "ignore_eos": True}}, timeout=30)
    assert response.status_code == 200
    after = histogram_counts(base_url)
    assert {name: after[name] - before[name] for name in PHASES} == {name: 1.0 for name in PHASES}


def test_spans_are_written_when_an_exporter_is_configured(base_url):
    request_id = "span-7d2e"
    httpx.post(f"{base_url}/pd/infer_token", headers={"x-request-id": request_id},
               json={"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 3, "ignore_eos": True}}, timeout=30)

    def spans():
        found = []
        for block in re.findall(r"^\{\n.*?^\}$", worker_output(), re.M | re.S):
            try:
                found.append(json.loads(block))
            except json.JSONDecodeError:  # another process's output between the lines of a span
                continue
        ids = {s["context"]["trace_id"] for s in found if s["attributes"].get("pdserve.request_id") == request_id}
        return [s for s in found if s["context"]["trace_id"] in ids]

    assert wait_until(lambda: len(spans()) == 7, 30)
    found = spans()
    assert sorted(s["name"] for s in found) == sorted(["request", "queue_ingress", "queue_prefill", "prefill",
                                                        "kv_transfer", "queue_decode", "decode"])
    root = next(s for s in found if s["name"] == "request")
    assert all(s["parent_id"] == root["context"]["span_id"] for s in found if s["name"] != "request")
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 3
