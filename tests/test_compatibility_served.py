"""A D started with another block size than P's, served: never paired (deployments/pd/compatibility.py).

Its own PD app (fp32 tiny-llama, one P with 16-token blocks, one D with 32-token blocks), deleted on
the way out: /health names the mismatch (the field, both values) and says degraded; every request
is answered whole by P alone, the same text as a greedy run on P, and D does no work for any of
them (its engine's counters, read from the replica itself, do not move)."""

from dataclasses import replace

import httpx
import pytest

from deployments.app import _args
from deployments.ingress.ingress import Ingress
from deployments.pd.kv_connector import make_kv_connector
from deployments.replicas.servers import DecodeServer, PrefillServer
from tests.serving import deploy, serve_session, wait_until, work_done

APP = "mismatch"
ARGS = {"torch_threads": 1, "dtype": "float32", "embeddings": False, "pd_local_prefill_tokens": 0}


def mismatched_app():
    """The PD app of ``ARGS`` (deployments/app.py's wiring), its D with 32-token blocks."""
    args = _args(ARGS)
    kv = make_kv_connector(args.kv_transport, args.kv_lease_s)
    prefill = PrefillServer.bind(args.engine_config(), None, args.max_loras, args.heartbeat_s, args.step_timeout_s, kv)
    decode_config = replace(args.engine_config(), first_token_from_prefill=True, block_size=32)
    decode = DecodeServer.bind(decode_config, None, args.max_loras, args.heartbeat_s, args.step_timeout_s,
                               args.kv_lease_s, kv)
    return Ingress.bind(args, prefill=prefill, decode=decode)


@pytest.fixture(scope="module")
def url():
    with serve_session() as base:
        deploy({APP: mismatched_app()})
        yield f"{base}/{APP}"


def test_a_d_with_another_block_size_is_never_paired_and_named_in_health(url):
    answers = []

    def named() -> bool:
        answers.append(httpx.get(url + "/health", timeout=30))
        return "incompatible" in answers[-1].json()

    assert wait_until(named, 60, 0.5), answers[-1].text
    health = answers[-1]
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert "incompatible prefill/decode" in health.json()["reason"]
    [line] = health.json()["incompatible"]
    assert line.startswith("DecodeServer ") and line.endswith("incompatible prefill/decode: block_size: P has 16, D has 32")
    before = work_done("DecodeServer", APP)
    body = {"model": "tiny-llama", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = [httpx.post(url + "/v1/completions", json={**body, "prompt": f"request {i}"}, timeout=120)
             for i in range(4)]
    assert [t.status_code for t in texts] == [200] * 4
    assert all(t.json()["usage"]["completion_tokens"] == 24 for t in texts)
    again = httpx.post(url + "/v1/completions", json={**body, "prompt": "request 0"}, timeout=120)
    assert again.json()["choices"][0]["text"] == texts[0].json()["choices"][0]["text"]  # greedy on P: the same
    assert work_done("DecodeServer", APP) == before  # D was sent nothing: no plan, no decode
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert 'where="prefill_only"' in metrics
