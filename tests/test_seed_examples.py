"""Every example request of the seeds (../shared/seeds/; SPEC.md is their digest), sent as written,
gets the documented answer: its status, its fields and their types. One row per example: a seed
with a new example adds a row to EXAMPLES.

In process (tests/inprocess_app.py): the ingress's own route methods (deployments/ingress/ingress.py),
the ingress's error handlers, the real engine client (admission, traces, first-output handling:
deployments/ingress/engine_client.py) and an AsyncEngine behind it, on a random Llama with a 32000-token vocabulary (the example's token ids go up to 19678; ids past
tiny-llama's tokenizer decode to no text). Only Ray's transport is left out: the served routes are
tested in tests/test_api_*.py and tests/test_serve_pd.py.

The seed 002 (Databricks) gives each task's fields and no example request: its rows send a body of
each task as its tables write one, with no ``model`` (the endpoint names it), to
POST /serving-endpoints/{name}/invocations. The seeds 003 (the Ascend operator) and 004
(TensorRT-LLM's InferenceRequest) give fields and tables but no example request: their rules are in
tests/test_dialect_mapping.py, test_seed_fidelity.py, test_sampling_npu.py and test_api_validation.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass
import json
import time
from typing import Callable

import pytest

from deployments.config import AppArgs
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.inprocess_app import InProcessApp
from tests.models import make_random_model

VOCAB = 32000  # Llama 2's, whose ids the /infer_token example uses
pytestmark = pytest.mark.slow  # the engine's start: ~50 s on a loaded 2-core box

# 000: /infer_token, the request example as written; its answers, text and streamed.
INFER_TOKEN = {
    "input_id": [5618, 19678, 701, 9072, 13],
    "stream": False,
    "parameters": {
        "temperature": 0.5,
        "top_k": 10,
        "top_p": 0.95,
        "max_new_tokens": 20,
        "do_sample": True,
        "seed": None,
        "repetition_penalty": 1.03,
        "details": True,
        "typical_p": 0.5,
        "watermark": False,
        "priority": 5,
        "timeout": 10,
    },
}
# 001: /v1/chat/completions, single- and multi-turn, as written (model gpt-3.5-turbo).
CHAT_SINGLE = {
    "model": "gpt-3.5-turbo",
    "messages": [{"role": "user", "content": "You are a helpful assistant."}],
    "max_tokens": 20,
    "presence_penalty": 1.03,
    "frequency_penalty": 1.0,
    "seed": None,
    "temperature": 0.5,
    "top_p": 0.95,
    "stream": False,
}
CHAT_MULTI = {**CHAT_SINGLE, "messages": [{"role": "system", "content": "You are a student who is good at math."},
                                          {"role": "user", "content": "what is your hobby?"}]}  # the rest as single
# 002: Databricks' chat and completions tasks, every field its tables list (their defaults where
# that is a value), sent to the endpoint that serves the model; embeddings need the embedder, which
# the served apps have (tests/test_api_openai.py).
INVOCATIONS = "/serving-endpoints/llama-32k/invocations"
DATABRICKS_CHAT = {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": "What is a mixture of experts model?"}],
                   "max_tokens": 20, "temperature": 0.5, "top_p": 1.0, "top_k": 10, "stop": [], "n": 1,
                   "logprobs": False, "stream": False}
DATABRICKS_COMPLETIONS = {"prompt": ["What is a mixture of experts model?", "Tell me a story"], "max_tokens": 20,
                          "temperature": 0.5, "top_p": 1.0, "top_k": 10, "error_behavior": "error", "n": 1,
                          "stop": [], "suffix": "", "echo": False, "use_raw_prompt": False, "stream": False}
MINDIE_FINISH = {"eos_token", "stop_sequence", "length"}  # 000's and 001's finish_reason values (bar "invalid flag")


def streamed(body: dict) -> dict:
    """The same example with "stream": true (the seeds show its streamed answer beside the text one)."""
    return {**copy.deepcopy(body), "stream": True}


def events(text: str) -> list:
    """The data of each SSE event, ``[DONE]`` as the string."""
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def check_infer_token_text(answer: dict, body: dict) -> None:
    assert set(answer) == {"generated_text", "details"} and isinstance(answer["generated_text"], str)
    details = answer["details"]
    assert {"finish_reason", "generated_tokens", "seed"} <= set(details)
    assert details["finish_reason"] in MINDIE_FINISH
    assert isinstance(details["generated_tokens"], int) and isinstance(details["seed"], int) and details["seed"] > 0
    cap = body["parameters"]["max_new_tokens"]
    assert 0 < details["generated_tokens"] <= cap
    assert (details["finish_reason"] == "length") == (details["generated_tokens"] == cap)


def check_infer_token_stream(data: list, body: dict) -> None:
    first, *middle, last = data
    assert isinstance(first["prefill_time"], float) and first["decode_time"] is None
    for event in [first, *middle]:
        assert isinstance(event["token"]["id"], int) and isinstance(event["token"]["text"], str)
    for event in [*middle, last]:
        assert event["prefill_time"] is None and isinstance(event["decode_time"], float)
    assert isinstance(last["token"]["id"], int) and last["token"]["text"] is None  # as the example's last event
    check_infer_token_text({"generated_text": last["generated_text"], "details": last["details"]}, body)
    assert last["details"]["generated_tokens"] == len(data)


def check_chat(answer: dict, body: dict) -> None:
    assert isinstance(answer["id"], str) and answer["object"] == "chat.completion"
    assert isinstance(answer["created"], int) and abs(answer["created"] - time.time()) < 600
    assert isinstance(answer["model"], str)
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in MINDIE_FINISH
    usage = answer["usage"]
    assert 0 < usage["completion_tokens"] <= body["max_tokens"] and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def check_chat_stream(data: list, body: dict) -> None:
    *chunks, done = data
    assert done == "[DONE]" and chunks
    ids = {chunk["id"] for chunk in chunks}
    assert len(ids) == 1 and all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] is None and isinstance(choice["delta"], dict)
    (end,) = chunks[-1]["choices"]
    assert end["finish_reason"] in MINDIE_FINISH
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def check_completions(answer: dict, body: dict) -> None:
    assert isinstance(answer["id"], str) and answer["object"] == "text_completion"
    assert isinstance(answer["created"], int) and abs(answer["created"] - time.time()) < 600
    assert [choice["index"] for choice in answer["choices"]] == list(range(len(body["prompt"])))
    assert all(isinstance(c["text"], str) and c["finish_reason"] in MINDIE_FINISH for c in answer["choices"])
    usage = answer["usage"]
    assert 0 < usage["completion_tokens"] <= body["max_tokens"] * len(body["prompt"]) and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@dataclass(frozen=True)
class Example:
    seed: str  # the seed file's number
    name: str
    route: str
    body: dict
    check: Callable[[object, dict], None]  # (the JSON answer, or the list of SSE events; the body)


EXAMPLES = [
    Example("000", "infer_token text", "/infer_token", INFER_TOKEN, check_infer_token_text),
    Example("000", "infer_token stream", "/infer_token", streamed(INFER_TOKEN), check_infer_token_stream),
    Example("001", "chat single-turn", "/v1/chat/completions", CHAT_SINGLE, check_chat),
    Example("001", "chat multi-turn", "/v1/chat/completions", CHAT_MULTI, check_chat),
    Example("001", "chat stream", "/v1/chat/completions", streamed(CHAT_SINGLE), check_chat_stream),
    Example("002", "invocations chat", INVOCATIONS, DATABRICKS_CHAT, check_chat),
    Example("002", "invocations chat stream", INVOCATIONS, streamed(DATABRICKS_CHAT), check_chat_stream),
    Example("002", "invocations completions", INVOCATIONS, DATABRICKS_COMPLETIONS, check_completions),
]


@pytest.fixture(scope="module")
def seed_app(tmp_path_factory) -> InProcessApp:
    """The ingress's generation routes for the seeds' dialects, colocated, with the seeds' names:
    gpt-3.5-turbo an alias of the model, MindIE's finish reasons (001's example answers eos_token)."""
    model = make_random_model(tmp_path_factory.mktemp("models") / "llama-32k", "llama", vocab_size=VOCAB)
    args = AppArgs(model=str(model), served_model_name="llama-32k", model_aliases=["gpt-3.5-turbo"],
                   finish_reasons="mindie")
    app = InProcessApp(AsyncEngine(EngineConfig(model=str(model), dtype="float32", max_iter_times=64,
                                                torch_threads=1)), args)
    # First calls' costs (the tokenizer's load, the engine's first steps) before the rows: 000's
    # example asks for a 10 s timeout, which a loaded box must not spend on them.
    for route, body in (("/infer_token", {"input_id": [5, 6], "parameters": {"max_new_tokens": 2}}),
                        ("/v1/chat/completions", {**CHAT_SINGLE, "max_tokens": 2})):
        assert app.post(route, body).status_code == 200
    yield app
    app.close()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"{e.seed}-{e.name}")
def test_a_seed_example_as_written_gets_the_documented_answer(example, seed_app):
    response = seed_app.post(example.route, example.body)
    assert response.status_code == 200, response.text
    if example.body.get("stream"):
        assert response.headers["content-type"].startswith("text/event-stream")
        example.check(events(response.text), example.body)
    else:
        example.check(response.json(), example.body)



def test_an_invocation_of_an_unknown_endpoint_is_a_404_in_databricks_shape(seed_app):
    """{name} that is no served model, an embeddings body where no embedder is served, a ``model``
    naming another model: Databricks' error body ``{"error_code", "message"}``."""
    for path, body, status, code in (
            ("/serving-endpoints/nobody/invocations", DATABRICKS_CHAT, 404, "RESOURCE_DOES_NOT_EXIST"),
            (INVOCATIONS, {"input": ["a"]}, 404, "RESOURCE_DOES_NOT_EXIST"),
            (INVOCATIONS, {**DATABRICKS_CHAT, "model": "another"}, 400, "INVALID_PARAMETER_VALUE"),
            (INVOCATIONS, {**DATABRICKS_CHAT, "temperature": 3.0}, 400, "INVALID_PARAMETER_VALUE")):
        response = seed_app.post(path, body)
        assert response.status_code == status, response.text
        assert set(response.json()) == {"error_code", "message"} and response.json()["error_code"] == code
    assert "model" in seed_app.post(INVOCATIONS, {**DATABRICKS_CHAT, "model": "another"}).json()["message"]
    assert "temperature" in seed_app.post(INVOCATIONS, {**DATABRICKS_CHAT, "temperature": 3.0}).json()["message"]
