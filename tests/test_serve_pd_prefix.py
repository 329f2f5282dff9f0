"""Prefix-aware PD on a real Ray Serve, over HTTP: decode-side reuse and local prefill give a cold
engine's tokens, a prefix D holds is not sent again (bytes counted), the policy chooses as
configured, priority holds across P, the hand-off and D under a saturating load, and every block
comes back. tests/test_pd_prefix.py has the engines' side."""

import asyncio
import re

import httpx
import pytest
from ray import serve

from deployments.app import pd_app
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.serving import (HEALTHY_AGAIN_S, assert_nothing_held, deploy, element_size, healthy, holdings,
                           migrations, serve_session, sse_events, wait_until)

pytestmark = pytest.mark.slow

THRESHOLD = 20  # the "pd" app's pd_local_prefill_tokens
APPS = {  # float64: reused and recomputed KV agree to the last bit, whatever the chunking
    # kv_lease_s far past any wait here: a prefix hold that lasts until it lapses fails the hold test
    "pd": {"pd_local_prefill_tokens": THRESHOLD, "kv_lease_s": 600},
    # Also the priority test's app: 2 sequences at a time (the conversations run one request at a time)
    "off": {"pd_local_prefill_tokens": 0, "pd_decode_prefix_reuse": False, "max_num_seqs": 2},
    "local": {"pd_local_prefill_tokens": 100_000},
}
PRIO = "off"  # the app whose D runs 2 sequences at a time


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        common = {"torch_threads": 1, "embeddings": False, "dtype": "float64"}
        apps = {name: pd_app({**common, **args}) for name, args in APPS.items()}
        apps["two"] = pd_app({**common, "pd_local_prefill_tokens": 0}, decode_options={"num_replicas": 2})
        deploy(apps)
        # Serve's RUNNING is not yet PD: an ingress that has not seen its D answer serves on P alone
        # (pd_degrade_to_prefill), and a conversation served so sends no KV (a full run saw it: 0 bytes).
        for name in apps:
            assert wait_until(lambda: healthy(f"{url}/{name}"), HEALTHY_AGAIN_S, 0.5), name
        yield url


@pytest.fixture(scope="module")
def cold():
    """A run on an engine without prefix caching, in this process: (prompt, parameters) -> tokens."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float64", enable_prefix_caching=False))

    def run(prompt: list[int], p: dict) -> list[int]:
        params = SamplingParams(max_new_tokens=p["max_new_tokens"], ignore_eos=True, do_sample=p["do_sample"],
                                temperature=p["temperature"], top_k=p.get("top_k", 0), seed=p.get("seed"))
        return engine.generate([GenerationRequest("cold", prompt, params)])["cold"].output_token_ids

    return run


def infer(url: str, app: str, prompt: list[int], **parameters) -> list[int]:
    """The tokens /infer_token streams for ``prompt``."""
    body = {"input_id": prompt, "stream": True, "parameters": {"ignore_eos": True, **parameters}}
    response = httpx.post(f"{url}/{app}/infer_token", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [event["token"]["id"] for event in sse_events(response)]


def metric(url: str, app: str, name: str, labels: str) -> float:
    text = httpx.get(f"{url}/{app}/metrics", timeout=30).text
    found = re.search(rf"^{name}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def stats(app: str, deployment: str):
    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result()


def kv_bytes(app: str) -> int:
    return serve.get_deployment_handle("DecodeServer", app_name=app).kv_transfers.remote().result()["bytes"]


def conversation(run, parameters: dict, salt: int, turns: int = 4) -> tuple[list[list[int]], list[int]]:
    """(each turn's output, each turn's prompt length): a 60-token system prompt, then each
    prompt is the one before, its answer and 30 new tokens; ``salt`` makes them this test's own."""
    history, outputs, lengths = [(11 * i + salt) % 800 + 3 for i in range(60)], [], []
    for k in range(turns):
        history += [(13 * k + 5 * j + salt) % 800 + 3 for j in range(30)]
        turn = {**parameters, "seed": parameters["seed"] + k} if "seed" in parameters else parameters
        outputs.append(run(list(history), turn))
        lengths.append(len(history))
        history += outputs[-1]
    return outputs, lengths


@pytest.mark.parametrize("salt, parameters", [
    (0, {"max_new_tokens": 8, "do_sample": False, "temperature": 1.0}),
    (1, {"max_new_tokens": 8, "do_sample": True, "temperature": 1.0, "top_k": 40, "seed": 21}),
], ids=["greedy", "seeded"])
def test_reuse_and_local_prefill_give_a_cold_engines_tokens_and_send_only_what_d_lacks(base_url, cold, salt,
                                                                                     parameters):
    want, lengths = conversation(cold, parameters, salt)
    before = {app: kv_bytes(app) for app in APPS}
    on_p = 'where="prefill"'
    remote_before = [metric(base_url, "pd", "pdserve_pd_prefill_decisions", f'reason="{reason}",{on_p}')
                     for reason in ("no_prefix_anywhere", "remote")]
    for app in APPS:
        got, _ = conversation(lambda prompt, p: infer(base_url, app, prompt, **p), parameters, salt)
        assert got == want, app
    sent = {app: kv_bytes(app) - before[app] for app in APPS}
    per_token = 4 * 2 * 4 * 32 * element_size("float64")  # tiny-llama: layers, (k, v), KV heads, head dim
    assert sent["off"] == per_token * sum(lengths)  # every turn's whole prompt
    # With reuse, a turn is sent only what D lacks: D holds every full block of the turn before
    # (its prompt and answer, less the answer's last token, whose KV was never computed).
    held = [0] + [(lengths[k - 1] + 8 - 1) // 16 * 16 for k in range(1, 4)]
    assert sent["pd"] == per_token * sum(n - h for n, h in zip(lengths, held))
    assert sent["pd"] * 2 < sent["off"]
    assert sent["local"] == 0  # D computed every prompt: nothing crossed
    # The first turn skips the plan (no D was sent any of it), each later one asks D and sends the rest.
    assert [metric(base_url, "pd", "pdserve_pd_prefill_decisions", f'reason="{reason}",{on_p}')
            for reason in ("no_prefix_anywhere", "remote")] == [remote_before[0] + 1, remote_before[1] + 3]
    assert metric(base_url, "pd", "pdserve_pd_prompt_tokens", 'source="decode_cache"') >= sum(held)


def test_with_two_decode_replicas_each_turn_goes_where_its_history_is(base_url, cold):
    """The router sends each turn's plan to the D replica that was sent the conversation so far
    (prefix affinity), and the decode call to the replica that answered (pinned): every turn
    finds the turn before in D's cache, and nothing migrates."""
    parameters = {"max_new_tokens": 8, "do_sample": False, "temperature": 1.0}
    held_before = metric(base_url, "two", "pdserve_pd_prompt_tokens", 'source="decode_cache"')
    for salt in (5, 6, 7):  # three conversations, spread over the two replicas by load
        got, lengths = conversation(lambda prompt, p: infer(base_url, "two", prompt, **p), parameters, salt)
        assert got == conversation(cold, parameters, salt)[0]
    held = sum((lengths[k - 1] + 8 - 1) // 16 * 16 for k in range(1, 4))  # the same lengths for each salt
    assert metric(base_url, "two", "pdserve_pd_prompt_tokens", 'source="decode_cache"') - held_before == 3 * held
    assert migrations(f"{base_url}/two") == 0


def test_the_policy_chooses_as_configured_and_says_so_in_metrics(base_url):
    def decisions(reason, where="decode"):
        return metric(base_url, "pd", "pdserve_pd_prefill_decisions", f'reason="{reason}",where="{where}"')

    transfers = serve.get_deployment_handle("DecodeServer", app_name="pd").kv_transfers
    short, cached, remote = decisions("short_prompt"), decisions("cached_prefix"), decisions("no_prefix_anywhere",
                                                                                             "prefill")
    count = transfers.remote().result()["count"]
    assert len(infer(base_url, "pd", list(range(3, 3 + THRESHOLD)), max_new_tokens=3)) == 3  # at the threshold
    assert (decisions("short_prompt"), transfers.remote().result()["count"]) == (short + 1, count)
    long_prompt = [(7 * i) % 800 + 5 for i in range(70)]  # past it, and no D was sent any: P, without a plan
    infer(base_url, "pd", long_prompt, max_new_tokens=3)
    assert (decisions("no_prefix_anywhere", "prefill"), transfers.remote().result()["count"]) == (remote + 1,
                                                                                                 count + 1)
    # D now holds the 64 tokens of its first 4 blocks: 10 more are within the threshold, D computes them.
    infer(base_url, "pd", long_prompt[:64] + [9] * 10, max_new_tokens=3)
    assert (decisions("cached_prefix"), transfers.remote().result()["count"]) == (cached + 1, count + 1)


def test_a_prefix_hold_ends_with_a_request_that_never_reached_d(base_url):
    """D holds the prefix it told the ingress of (plan) for the request; a request that P's first token
    ends never comes to D, and the ingress tells D so (``release``): the hold ends with the request,
    not when the app's kv_lease_s (600 s here) lapses."""
    prompt = [(11 * i) % 800 + 5 for i in range(70)]
    infer(base_url, "pd", prompt, max_new_tokens=3)  # no prefix anywhere: through P, D keeps the KV
    # D holds the first 32 tokens (two blocks); the 40 after them are past the threshold: P computes them
    # and its first token is the whole answer, so D is never called
    remote = metric(base_url, "pd", "pdserve_pd_prefill_decisions", 'reason="remote",where="prefill"')
    holds_seen = []

    def released() -> bool:
        holds_seen.append(sum(h["prefix_holds"] for h in holdings("DecodeServer", "pd").values()))
        return holds_seen[-1] == 0

    assert len(infer(base_url, "pd", prompt[:32] + [9] * 40, max_new_tokens=1)) == 1
    assert metric(base_url, "pd", "pdserve_pd_prefill_decisions", 'reason="remote",where="prefill"') == remote + 1
    assert wait_until(released, 60, 0.2), f"D's prefix holds: {holds_seen[-5:]}"


def test_priority_holds_across_p_the_hand_off_and_d_under_a_saturating_load(base_url):
    """D runs 2 sequences at a time. Six priority-5 requests fill it and its queue; then two
    priority-1 requests come: each is admitted at D's next free slot, ahead of every waiting
    priority-5 one, and its KV is fetched then (D fetches a request's KV when it admits it)."""
    order: list[str] = []

    async def one(client, name, priority, tokens):
        body = {"input_id": [5 + int(name[-1]) + 10 * priority, 6, 7, 8] * 8, "parameters": {
            "max_new_tokens": tokens, "ignore_eos": True, "priority": priority}}
        response = await client.post(f"{base_url}/{PRIO}/infer_token", json=body)
        assert response.status_code == 200, response.text
        order.append(name)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            low = [asyncio.create_task(one(client, f"low{i}", 5, 160)) for i in range(6)]
            saturated = await asyncio.to_thread(wait_until, lambda: (
                stats(PRIO, "DecodeServer").running == 2
                and stats(PRIO, "DecodeServer").waiting_by_priority[5] == 4), 60, 0.05)
            assert saturated, "D should run two priority-5 requests and queue four"
            high = [asyncio.create_task(one(client, f"high{i}", 1, 4)) for i in range(2)]
            await asyncio.gather(*low, *high)

    asyncio.run(run())
    # Both priority-1 requests end before the third priority-5 one: they were admitted ahead of
    # every priority-5 one that waited (the first two ran already).
    lows = [name for name in order if name.startswith("low")]
    assert max(order.index("high0"), order.index("high1")) < order.index(lows[2]), order
    for app in ("two", *APPS):  # every replica of each (two has two D), each read directly
        assert_nothing_held(["PrefillServer", "DecodeServer"], app)
