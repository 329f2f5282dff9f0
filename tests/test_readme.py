"""The README's commands, run as a newcomer runs them: `make serve`, and each `serve run` line for
a real model with a locally made Qwen3 directory in place of the example path. Each must become
healthy (a canary through P and D) and answer both dialects. Ray and Serve start for real on
127.0.0.1:8000, as the README says; each server is stopped before the next starts."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
import shlex
import signal
import subprocess

import httpx
import pytest

from tests.models import make_random_model
from tests.serving import stop_shared_session, wait_until

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLE_MODEL = "/models/Qwen3-0.6B"
URL = "http://127.0.0.1:8000"
START_LIMIT_S = 300  # the longest a start may take here before the test fails (2 cores, Ray's own start included)

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]


@pytest.fixture(scope="module", autouse=True)
def no_other_ray():
    """`serve run` starts a Ray of its own: the suite's shared one must not run beside it."""
    stop_shared_session()


def readme_serve_lines() -> list[str]:
    return [line.strip() for line in README.splitlines() if line.strip().startswith(".venv/bin/serve run ")]


@contextlib.contextmanager
def running(command: list[str], log: Path):
    """``command`` in its own process group (Ray's processes with it), its output in ``log``;
    SIGINT at the end, as a user stops it, and SIGKILL if it has not stopped a minute later."""
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a Ray of its own, whatever ran before
    with contextlib.closing(httpx.Client(timeout=5)) as probe:
        with contextlib.suppress(httpx.HTTPError):
            probe.get(URL)
            pytest.fail(f"something already listens on {URL}; stop it first")
    with open(log, "w") as output:
        # SIGINT as a terminal delivers it: a shell that started the tests in the background left
        # it ignored, and `serve run` would then never hear the stop (and be killed a minute later).
        process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, stdout=output,
                                   stderr=subprocess.STDOUT, preexec_fn=default_sigint)
    try:
        yield process
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        assert wait_until(lambda: not listening(), 60), "the server still answers after it was stopped"


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def listening() -> bool:
    try:
        httpx.get(f"{URL}/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def healthy() -> bool:
    try:
        return httpx.get(f"{URL}/health", timeout=15).status_code == 200
    except httpx.HTTPError:
        return False


def check_both_dialects(model_name: str) -> None:
    mindie = httpx.post(f"{URL}/infer_token", json={"input_id": [1, 400, 52, 88, 13], "parameters": {
        "max_new_tokens": 5, "ignore_eos": True, "details": True}}, timeout=60)
    assert mindie.status_code == 200, mindie.text
    assert mindie.json()["details"]["generated_tokens"] == 5
    chat = httpx.post(f"{URL}/v1/chat/completions", json={"model": model_name, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
    embedding = httpx.post(f"{URL}/v1/embeddings", json={"input": "a sentence"}, timeout=60)
    assert embedding.status_code == 200 and len(embedding.json()["data"][0]["embedding"]) == 384


def test_the_readme_has_both_real_model_lines():
    lines = readme_serve_lines()
    builders = [line.split()[2] for line in lines]
    assert builders == ["deployments.app:build_pd_app", "deployments.app:build_colocated_app"]
    assert all(EXAMPLE_MODEL in line for line in lines)


@pytest.mark.parametrize("line", readme_serve_lines(), ids=lambda line: line.split()[2].rsplit(":", 1)[-1])
def test_readme_serve_run_line(tmp_path, line):
    model = make_random_model(tmp_path / "Qwen3-0.6B", "qwen3")
    log = tmp_path / "serve.log"
    with running(shlex.split(line.replace(EXAMPLE_MODEL, str(model))), log) as process:
        assert wait_until(lambda: healthy() or process.poll() is not None, START_LIMIT_S, interval_s=2)
        assert process.poll() is None, log.read_text()[-4000:]
        check_both_dialects("Qwen3-0.6B")


def test_make_serve(tmp_path):
    log = tmp_path / "serve.log"
    with running(["make", "serve"], log) as process:
        assert wait_until(lambda: healthy() or process.poll() is not None, START_LIMIT_S, interval_s=2)
        assert process.poll() is None, log.read_text()[-4000:]
        check_both_dialects("SmolLM2-135M-Instruct")  # configs/local.yaml's served_model_name
