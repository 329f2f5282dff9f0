"""The app's prefix store on a real Ray Serve (deployments/replicas/prefix_store.py): a prompt one
P replica computed is served by another P replica from the store, without computing its blocks
(counted per replica and on /metrics), with the first one's tokens; the store outlives the P
replica that published. tests/test_prefix_store.py has the store's rules, model-free."""

import re

import httpx
import pytest
import ray

from deployments.app import pd_app
from tests.serving import (call_replica, deploy, replicas, serve_session, sigkill, replica_process, sse_events,
                           wait_running, wait_until)

pytestmark = pytest.mark.slow

APP = "store"
BLOCK = 16  # the engines' block size
PROMPT = list(range(5, 5 + 6 * BLOCK + 3))  # six full blocks, then three tokens


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        # float32; D neither holds nor computes prompts: every prompt token is P's, or the store's.
        args = {"torch_threads": 1, "embeddings": False, "dtype": "float32", "prefix_store_mib": 64,
                "pd_local_prefill_tokens": 0, "pd_decode_prefix_reuse": False}
        deploy({APP: pd_app(args, prefill_options={"num_replicas": 2})})
        yield url


def infer(url: str, prompt: list[int]) -> list[int]:
    body = {"input_id": prompt, "stream": True,
            "parameters": {"ignore_eos": True, "max_new_tokens": 6, "do_sample": False}}
    response = httpx.post(f"{url}/{APP}/infer_token", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [event["token"]["id"] for event in sse_events(response)]


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(f"{url}/{APP}/metrics", timeout=30).text
    found = re.search(rf"^{name}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def computed_by_replica() -> dict[str, int]:
    """Prompt tokens each live P replica has run through its model."""
    return {name: call_replica(name, "stats").prompt_tokens_computed for name in replicas("PrefillServer", APP)}


def all_answer() -> bool:
    """Whether every live P replica answers (one Serve starts is named before it has started)."""
    try:
        computed_by_replica()
    except ray.exceptions.RayError:
        return False
    return True


def test_a_second_prefill_replica_serves_a_prefix_the_first_computed_without_computing_it(base_url):
    before = computed_by_replica()
    first_tokens = infer(base_url, PROMPT)
    after = computed_by_replica()
    first = next(name for name in after if after[name] > before.get(name, 0))
    assert after[first] - before[first] == len(PROMPT)  # the first P computed the whole prompt
    # P publishes its six full blocks after its reply.
    assert wait_until(lambda: metric(base_url, "pdserve_prefix_store_blocks", 'event="published"') >= 6, 60)

    # The first P goes; the prompt's next P (the other, or the one Serve starts instead) has none of it.
    sigkill(replica_process(first))
    assert wait_until(lambda: first not in replicas("PrefillServer", APP), 60)
    assert wait_until(lambda: len(replicas("PrefillServer", APP)) == 2 and all_answer(), 180, 1)
    wait_running([APP])
    before = computed_by_replica()
    pulls = metric(base_url, "pdserve_prefix_store_calls", 'event="pulls"')

    assert infer(base_url, PROMPT) == first_tokens
    after = computed_by_replica()
    # Only the last block's three tokens were computed: the six full blocks came from the store
    # (a prompt's last token is always computed: it gives the first token's logits).
    assert sum(after[name] - before.get(name, 0) for name in after) == 3
    assert metric(base_url, "pdserve_prefix_store_calls", 'event="pulls"') == pulls + 1
    assert metric(base_url, "pdserve_prefix_store_blocks", 'event="pulled_blocks"') >= 6
