"""The OpenAI-compatible API on the PD and colocated apps, through the official openai client."""

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from deployments.replicas.embeddings import default_model_dir
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from engine.execution.tiny_model import ensure_tiny_model
from sampling import SamplingParams
from tests.serving import OPENAI_APPS_CAP, openai_apps
from tests.test_vllm_extensions import vllm_bench_chat, vllm_bench_completion

MODEL = "tiny-llama"  # vllm_bench_* name it too
CAP = OPENAI_APPS_CAP  # max_iter_times of the kept OpenAI pair
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Grüße, wie geht's?"}]


@pytest.fixture(scope="module")
def base_url():
    return openai_apps()


@pytest.fixture(scope="module")
def reference():
    """The in-process engine and tokenizer: what the server must answer."""
    return LLMEngine(EngineConfig(model=MODEL)), AutoTokenizer.from_pretrained(ensure_tiny_model())


def client(base_url, app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="unused", max_retries=0)


def greedy_reference(reference, prompt_ids, max_tokens):
    engine, _ = reference
    rid = f"ref-{len(prompt_ids)}-{prompt_ids[-1]}-{max_tokens}"
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    return engine.generate([GenerationRequest(rid, prompt_ids, params)])[rid]


APPS = ["pd", "co"]


@pytest.mark.parametrize("app", APPS)
def test_chat_matches_engine_and_counts_template_tokens(base_url, reference, app):
    _, tokenizer = reference
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    expected = greedy_reference(reference, prompt_ids, 10)
    response = client(base_url, app).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                             temperature=0)
    assert response.object == "chat.completion" and response.model == MODEL
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == {"eos_token": "stop", "length": "length"}[expected.finish_reason]
    assert response.usage.prompt_tokens == len(prompt_ids) > sum(len(m["content"]) for m in MESSAGES) // 4
    assert response.usage.completion_tokens == expected.num_output_tokens
    assert response.usage.total_tokens == len(prompt_ids) + expected.num_output_tokens


@pytest.mark.parametrize("app", APPS)
def test_prompt_lookup_per_request_gives_the_same_answer(base_url, app):
    c = client(base_url, app)
    asked = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.7, seed=9)
    plain = c.chat.completions.create(**asked)
    looked_up = c.chat.completions.create(**asked, extra_body={"prompt_lookup": True})
    assert looked_up.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as error:  # grammars run without drafts
        c.chat.completions.create(**asked, extra_body={"prompt_lookup": True},
                                  response_format={"type": "json_object"})
    assert error.value.body["param"] == "prompt_lookup"


@pytest.mark.parametrize("app", APPS)
def test_streamed_chat_equals_the_whole_answer(base_url, app):
    c = client(base_url, app)
    whole = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishing = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].delta.content is None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_raw_stream_ends_with_done(base_url):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    response = httpx.post(f"{base_url}/pd/v1/chat/completions", json=body, timeout=60)
    blocks = [b for b in response.text.split("\n\n") if b]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert blocks[-1] == "data: [DONE]" and all(b.startswith("data: {") for b in blocks[:-1])


@pytest.mark.parametrize("app", APPS)
def test_vllm_bench_serve_bodies_succeed(base_url, app):
    """The bodies `vllm bench serve` sends by default (its openai and openai-chat backends, with
    --ignore-eos; tests/test_vllm_extensions.py builds them as vLLM's source does): a 200 stream
    of chunks, then usage with every token, then [DONE]."""
    for path, body in (("completions", vllm_bench_completion("Hello there", 6)),
                       ("chat/completions", vllm_bench_chat("Hello there", 6))):
        with httpx.stream("POST", f"{base_url}/{app}/v1/{path}", json={**body, "ignore_eos": True},
                          timeout=60) as response:
            assert response.status_code == 200, response.read()
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert any(c["choices"] for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("app", APPS)
def test_tokenize_and_detokenize_as_vllm_shapes_them(base_url, reference, app):
    engine, tokenizer = reference
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    chat = httpx.post(f"{base_url}/{app}/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json() == {"count": len(prompt_ids), "max_model_len": engine.max_model_len, "tokens": prompt_ids,
                           "token_strs": None}
    text = httpx.post(f"{base_url}/{app}/tokenize", json={"prompt": "Grüße"}, timeout=60).json()
    assert text["tokens"] == tokenizer.encode("Grüße")
    back = httpx.post(f"{base_url}/{app}/detokenize", json={"tokens": text["tokens"][1:]}, timeout=60)
    assert back.status_code == 200 and back.json() == {"prompt": "Grüße"}
    refused = httpx.post(f"{base_url}/{app}/detokenize", json={"tokens": [10**6]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens.0"


@pytest.mark.parametrize("app", APPS)
def test_n_choices_are_independent_and_seeded(base_url, app):
    c = client(base_url, app)
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=11, temperature=1.0)
    first, again = c.chat.completions.create(**args), c.chat.completions.create(**args)
    texts = [ch.message.content for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in again.choices]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == sum(8 for _ in texts)


def test_chat_logprobs(base_url):
    response = client(base_url, "pd").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                              temperature=0, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())


@pytest.mark.parametrize("app", APPS)
def test_completions_batch_echo_suffix_stop(base_url, reference, app):
    _, tokenizer = reference
    c = client(base_url, app)
    prompts = ["hello world", "Über den Wolken"]
    response = c.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, echo=True,
                                    extra_body={"suffix": "<END>"})
    assert response.object == "text_completion" and len(response.choices) == 4
    for choice in response.choices:
        prompt = prompts[choice.index // 2]
        expected = greedy_reference(reference, tokenizer.encode(prompt), 6)
        assert choice.text == prompt + expected.text + "<END>"
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    plain = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0).choices[0].text
    stop = plain[3:6]
    cut = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == plain[: plain.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_completions_logprobs_and_stream(base_url):
    c = client(base_url, "pd")
    whole = c.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == whole.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, temperature=0, stream=True))
    assert streamed == whole.choices[0].text


def test_use_raw_prompt_skips_the_bos(base_url, reference):
    _, tokenizer = reference
    c = client(base_url, "co")
    cooked = c.completions.create(model=MODEL, prompt="hello", max_tokens=1, temperature=0)
    raw = c.completions.create(model=MODEL, prompt="hello", max_tokens=1, temperature=0,
                               extra_body={"use_raw_prompt": True})
    assert cooked.usage.prompt_tokens == raw.usage.prompt_tokens + 1 == len(tokenizer.encode("hello"))


def test_error_behavior_truncate_keeps_the_end_of_a_long_prompt(base_url):
    long_prompt = "word " * 5000  # more tokens than 4096 - 64 fit
    c = client(base_url, "co")
    with pytest.raises(openai.BadRequestError) as error:
        c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert error.value.body["param"] == "prompt" and error.value.body["code"] == "context_length_exceeded"
    truncated = c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2,
                                     extra_body={"error_behavior": "truncate"})
    assert truncated.usage.prompt_tokens == 4096 - CAP and truncated.usage.completion_tokens == 2


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings_equal_sentence_transformers(base_url, encoding):
    from sentence_transformers import SentenceTransformer

    texts = ["The quick brown fox.", "Grüße aus Köln", "大语言模型推理服务"]
    expected = SentenceTransformer(str(default_model_dir()), device="cpu").encode(texts)
    response = client(base_url, "pd").embeddings.create(model="all-MiniLM-L6-v2", input=texts,
                                                        encoding_format=encoding)
    assert [d.index for d in response.data] == [0, 1, 2]
    got = np.array([d.embedding for d in response.data]) if encoding == "float" else None
    if encoding == "base64":  # the client decodes base64 itself when it asked for floats; here it did not
        raw = httpx.post(f"{base_url}/pd/v1/embeddings", json={"input": texts, "encoding_format": "base64"},
                         timeout=60).json()
        got = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert got.shape == (3, 384)
    assert np.abs(got - expected).max() < 1e-5
    assert response.usage.prompt_tokens > 0


def test_databricks_invocations_answer_each_task_as_its_openai_route(base_url):
    """POST /serving-endpoints/{name}/invocations (seeds/002): the body's field picks the task, the
    endpoint the model; greedy chat and completions answer as their /v1 routes do, embeddings equal
    /v1/embeddings'. An endpoint naming no served model is Databricks' 404."""
    def invoke(endpoint: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base_url}/pd/serving-endpoints/{endpoint}/invocations", json=body, timeout=120)

    chat = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    completion = {"prompt": ["Hello there", "Once upon"], "max_tokens": 6, "temperature": 0}
    for body, route in ((chat, "chat/completions"), (completion, "completions")):
        answer = invoke(MODEL, body)
        assert answer.status_code == 200, answer.text
        expected = httpx.post(f"{base_url}/pd/v1/{route}", json={**body, "model": MODEL}, timeout=120).json()
        assert answer.json()["model"] == MODEL and answer.json()["object"] == expected["object"]
        assert answer.json()["choices"] == expected["choices"] and answer.json()["usage"] == expected["usage"]
    texts = ["The quick brown fox.", "Grüße aus Köln"]
    embedded = invoke("all-MiniLM-L6-v2", {"input": texts})
    assert embedded.status_code == 200, embedded.text
    expected = httpx.post(f"{base_url}/pd/v1/embeddings", json={"input": texts}, timeout=60).json()
    for got, want in zip(embedded.json()["data"], expected["data"], strict=True):
        assert got["embedding"] == pytest.approx(want["embedding"], abs=1e-6)
    missing = invoke("no-such-endpoint", chat)
    assert missing.status_code == 404 and missing.json()["error_code"] == "RESOURCE_DOES_NOT_EXIST"


def test_errors_come_as_the_clients_exception_classes(base_url):
    c = client(base_url, "pd")
    with pytest.raises(openai.NotFoundError) as error:
        c.chat.completions.create(model="other-model", messages=MESSAGES)
    assert error.value.body["param"] == "model"
    for kwargs, param in [({"temperature": 2.5}, "temperature"), ({"max_tokens": CAP + 1}, "max_tokens"),
                          ({"response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "nope"}}}}, "response_format.json_schema.schema"),
                          ({"tools": [{"type": "function", "function": {"name": "f"}}],
                            "tool_choice": {"type": "function", "function": {"name": "g"}}},
                           "tool_choice.function.name"),
                          ({"top_logprobs": 3}, "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as error:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert param in (error.value.body["param"] or "") + error.value.body["message"], (kwargs, error.value.body)


def test_models_health_metrics(base_url):
    c = client(base_url, "pd")
    assert {m.id for m in c.models.list()} == {MODEL, "all-MiniLM-L6-v2"}
    assert httpx.get(f"{base_url}/pd/health").status_code == 200
    c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    text = httpx.get(f"{base_url}/pd/metrics").text
    for needle in ['pdserve_requests_total{endpoint="/v1/chat/completions",priority="5",status="200"}',
                   "pdserve_time_to_first_token_seconds_bucket", "pdserve_time_per_output_token_seconds_bucket",
                   'pdserve_queue_depth{deployment="PrefillServer",priority="1"}',
                   'pdserve_kv_blocks{deployment="DecodeServer",state="free"}',
                   'pdserve_kv_blocks{deployment="PrefillServer",state="used"}', "pdserve_kv_bytes_moved",
                   'pdserve_engine_requests_finished{deployment="DecodeServer",reason="length"}']:
        assert needle in text, needle
    moved = [line for line in text.splitlines() if line.startswith("pdserve_kv_bytes_moved ")]
    assert float(moved[0].split()[1]) > 0


def test_body_over_the_cap_is_a_413(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    response = httpx.post(f"{base_url}/pd/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_openapi_documents_fields_with_ranges(base_url):
    schema = httpx.get(f"{base_url}/pd/openapi.json", timeout=30).json()
    assert {"/infer_token", "/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= set(schema["paths"])
    components = schema["components"]["schemas"]
    top_p = components["InferParameters"]["properties"]["top_p"]["anyOf"][0]
    assert top_p["exclusiveMinimum"] == 0.0 and top_p["exclusiveMaximum"] == 1.0
    temperature = components["ChatCompletionRequest"]["properties"]["temperature"]
    assert temperature["minimum"] == 0.0 and temperature["maximum"] == 2.0
    assert components["InferParameters"]["properties"]["priority"]["maximum"] == 5
