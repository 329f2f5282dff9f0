"""A D of another build than P's, served: never paired (deployments/pd/compatibility.py).

Its own PD app (fp32 tiny-llama, one P with 16-token blocks, one D with 32-token blocks and a copy of
the model whose weights differ, same name), deleted on the way out: /health names both mismatches
(the fields, both values) and says degraded; every request is answered whole by P alone, the same
text as a greedy run on P, and D does no work for any of them (its engine's counters, read from the
replica itself, do not move). tools/mismatches.py injects each kind of mismatch alone."""

from pathlib import Path

import httpx
import pytest

from deployments.app import pd_app
from tests.serving import HEALTHY_AGAIN_S, deploy, serve_session, wait_until, work_done
from tools.mismatches import tiny_copy

APP = "mismatch"
ARGS = {"torch_threads": 1, "dtype": "float32", "embeddings": False, "pd_local_prefill_tokens": 0}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    other_weights = tiny_copy(Path(tmp_path_factory.mktemp("mismatch")), "weights")
    with serve_session() as base:
        deploy({APP: pd_app(ARGS, decode_engine={"block_size": 32, "model": other_weights})})
        yield f"{base}/{APP}"


def test_a_d_with_other_weights_and_block_size_is_never_paired_and_named_in_health(url):
    answers = []

    def named() -> bool:
        answers.append(httpx.get(url + "/health", timeout=30))
        return "incompatible" in answers[-1].json()

    def degraded() -> bool:  # the canary through P alone succeeded (before it, 503 names the mismatch too)
        return named() and answers[-1].status_code == 200

    assert wait_until(degraded, HEALTHY_AGAIN_S, 0.5), answers[-1].text
    health = answers[-1]
    assert health.json()["status"] == "degraded"
    assert "incompatible prefill/decode" in health.json()["reason"]
    [line] = health.json()["incompatible"]
    assert line.startswith("DecodeServer ")
    why = line.split("incompatible prefill/decode: ", 1)[1].split("; ")
    assert [reason.split(":")[0] for reason in why] == ["weights_digest", "block_size"], line
    assert why[1] == "block_size: P has 16, D has 32"
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
