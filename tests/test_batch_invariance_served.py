"""Batch invariance as served by default (docs/sampling.md): the PD app in bfloat16 with no mode
asked for, in its settings or in its replicas' environment (the suite's PDSERVE_BATCH_INVARIANT=1
emptied for them). Where bf16 defaults to the mode (every CPU but one that multiplies bf16
natively without the dot-product GEMM built), /v1/models says so and a seeded request gets the
same tokens and logprobs over HTTP alone and in a crowd of concurrent requests."""

import concurrent.futures

import httpx
import pytest
import torch

from deployments.app import pd_app
from engine.execution.attention import batch_invariant_by_default
from tests.serving import deploy, serve_session

# The replicas' environment without the suite's choice: an empty value leaves the engine's default.
DEFAULT_MODE = {"ray_actor_options": {"runtime_env": {"env_vars": {"PDSERVE_BATCH_INVARIANT": ""}}}}
SEEDED = [{"prompt": prompt, "seed": 100 + i} for i, prompt in enumerate(["Once upon a time", "The capital of"])]
CROWD = [f"Request {i} asks about {topic}" for i, topic in enumerate(["rivers", "stars", "bread", "trains"] * 3)]


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        deploy({"pd-default": pd_app({"torch_threads": 1, "embeddings": False, "dtype": "bfloat16",
                                      "pd_local_prefill_tokens": 0},
                                     prefill_options=DEFAULT_MODE, decode_options=DEFAULT_MODE)})
        yield f"{url}/pd-default"


def complete(client: httpx.Client, base_url: str, prompt: str, seed: int | None) -> tuple:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "logprobs": 2,
            "seed": seed, "ignore_eos": True}
    response = client.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def test_a_seeded_request_is_the_same_alone_and_in_a_crowd_by_default(base_url):
    with httpx.Client() as client:
        card = client.get(f"{base_url}/v1/models").json()["data"][0]
        assert card["dtype"] == "bfloat16"
        assert card["batch_invariant"] == batch_invariant_by_default(torch.device("cpu"), torch.bfloat16)
        if not card["batch_invariant"]:
            pytest.skip("bf16 defaults to the fastest mode on this CPU (AMX/AVX512-BF16 without the dot-product GEMM)")
        alone = [complete(client, base_url, s["prompt"], s["seed"]) for s in SEEDED]
    with concurrent.futures.ThreadPoolExecutor(len(CROWD) + len(SEEDED)) as pool:
        def call(prompt, seed):
            with httpx.Client() as own:
                return complete(own, base_url, prompt, seed)

        others = [pool.submit(call, prompt, None) for prompt in CROWD[:6]]
        crowded = [pool.submit(call, s["prompt"], s["seed"]) for s in SEEDED]
        others += [pool.submit(call, prompt, None) for prompt in CROWD[6:]]
        assert [future.result() for future in crowded] == alone
        assert all(len(future.result()[1]) == 12 for future in others)
