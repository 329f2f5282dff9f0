"""Every rejection is a 4xx naming the field; the documents' own examples are accepted."""

import threading

import httpx
import pytest
from ray import serve

from deployments.app import colocated_app
from tests.models import make_random_model
from tests.serving import OPENAI_APPS_CAP, deploy, openai_apps, serve_session, sse_events, wait_until

CAP = OPENAI_APPS_CAP  # max_iter_times of the kept OpenAI pair, whose PD app (with the embedder) is "pd" here
CHAT = [{"role": "user", "content": "hi"}]
M = "tiny-llama"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    big_vocab = make_random_model(tmp_path_factory.mktemp("big") / "m", "llama", vocab_size=32000)
    with serve_session() as url:
        openai_apps()  # "<base>/openai/pd", deployed now if no module before kept it
        deploy({
            # The documents' examples: token ids up to 29945, and the model name "gpt-3.5-turbo".
            "docs": colocated_app({"model": str(big_vocab), "served_model_name": "gpt-3.5-turbo", "torch_threads": 1,
                                   "embeddings": False}),
            # One request at a time, so that a second one waits in the queue.
            "busy": colocated_app({"torch_threads": 1, "max_num_seqs": 1, "embeddings": False})})
        yield url


def infer(**parameters):
    return {"input_id": [5, 6, 7], "parameters": parameters}


def chat(**fields):
    return {"model": M, "messages": CHAT, **fields}


def tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOL = tool("f", {"a": {"type": "integer"}})


def completion(**fields):
    return {"model": M, "prompt": "hello", **fields}


# (path, body: dict or raw bytes, status, the field the error must name: param, or a code for whole-body errors)
CASES = [
    ("/infer_token", b"", 400, "code:missing_body"),
    ("/infer_token", b"{not json", 400, "code:invalid_json"),
    ("/infer_token", {}, 400, "input_id"),
    ("/infer_token", {"input_id": []}, 400, "input_id"),
    ("/infer_token", {"input_id": "abc"}, 400, "input_id"),
    ("/infer_token", {"input_id": [1.5]}, 400, "input_id.0"),
    ("/infer_token", {"input_id": [-1]}, 400, "input_id"),
    ("/infer_token", {"input_id": [10**7]}, 400, "input_id"),
    ("/infer_token", {"input_id": [5000]}, 400, "input_id"),
    ("/infer_token", {"input_id": [5], "stream": "yes"}, 400, "stream"),
    ("/infer_token", {"input_id": [5], "prompt": "x"}, 400, "prompt"),
    ("/infer_token", infer(temperature=0), 400, "parameters.temperature"),
    ("/infer_token", infer(temperature=-1), 400, "parameters.temperature"),
    ("/infer_token", infer(top_k=0), 400, "parameters.top_k"),
    ("/infer_token", infer(top_k=2**31), 400, "parameters.top_k"),
    ("/infer_token", infer(top_p=1.0), 400, "parameters.top_p"),
    ("/infer_token", infer(top_p=0.0), 400, "parameters.top_p"),
    ("/infer_token", infer(max_new_tokens=0), 400, "parameters.max_new_tokens"),
    ("/infer_token", infer(seed=0), 400, "parameters.seed"),
    ("/infer_token", infer(seed=2**64), 400, "parameters.seed"),
    ("/infer_token", infer(repetition_penalty=0), 400, "parameters.repetition_penalty"),
    ("/infer_token", infer(typical_p=1.5), 400, "parameters.typical_p"),
    ("/infer_token", infer(priority=0), 400, "parameters.priority"),
    ("/infer_token", infer(priority=6), 400, "parameters.priority"),
    ("/infer_token", infer(timeout=0), 400, "parameters.timeout"),
    ("/infer_token", infer(timeout=3601), 400, "parameters.timeout"),
    ("/infer_token", infer(do_sample="true"), 400, "parameters.do_sample"),
    ("/infer_token", infer(foo=1), 400, "parameters.foo"),
    ("/infer_token", infer(stop_words=[[]]), 400, "parameters.stop_words.0"),
    ("/infer_token", infer(bad_words=[[99999]]), 400, "parameters.bad_words"),
    ("/infer_token", infer(embedding_bias=[0.0, 1.0]), 400, "parameters.embedding_bias"),
    ("/infer_token", infer(presence_penalty=3), 400, "parameters.presence_penalty"),
    ("/infer_token", infer(end_id=10**6), 400, "parameters.end_id"),
    ("/infer_token", infer(top_log_probs=21), 400, "parameters.top_log_probs"),
    ("/v1/chat/completions", {"messages": CHAT}, 400, "model"),
    ("/v1/chat/completions", chat(model="-bad"), 400, "model"),
    ("/v1/chat/completions", chat(model="x" * 300), 400, "model"),
    ("/v1/chat/completions", chat(model="not-served"), 404, "model"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": ""}]), 400, "messages.0.content"),
    ("/v1/chat/completions", chat(messages=CHAT + [{"role": "system", "content": "late"}]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * (600 * 1024)}]), 400, "messages"),
    ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=CAP + 1), 400, "max_tokens"),
    ("/v1/chat/completions", chat(temperature=2.5), 400, "temperature"),
    ("/v1/chat/completions", chat(top_p=-0.1), 400, "top_p"),  # 0 is greedy (Databricks)
    ("/v1/chat/completions", chat(top_k=-2), 400, "top_k"),
    ("/v1/chat/completions", chat(min_p=1.5), 400, "min_p"),
    ("/v1/chat/completions", chat(repetition_penalty=2.5), 400, "repetition_penalty"),
    ("/v1/chat/completions", chat(min_tokens=2, stop=["x"]), 400, "min_tokens"),
    ("/v1/chat/completions", chat(stop_token_ids=[10**6]), 400, "stop_token_ids.0"),
    ("/v1/completions", completion(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"),
    ("/v1/chat/completions", chat(n=0), 400, "n"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(seed=-1), 400, "seed"),
    ("/v1/chat/completions", chat(stop=[""]), 400, "stop"),
    ("/v1/chat/completions", chat(presence_penalty=-3), 400, "presence_penalty"),
    ("/v1/chat/completions", chat(frequency_penalty=2.5), 400, "frequency_penalty"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {}}), 400, "response_format"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}), 400,
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "bad name", "schema": {}}}), 400, "response_format.json_schema.name"),
    ("/v1/chat/completions", chat(response_format={"type": "json_object", "json_schema": {
        "name": "x", "schema": {}}}), 400, "response_format.json_schema"),
    ("/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", chat(tools=[TOOL] * 33), 400, "tools"),
    ("/v1/chat/completions", chat(structured_outputs={}), 400, "structured_outputs"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a", "choice": ["a"]}), 400, "structured_outputs"),
    ("/v1/chat/completions", chat(structured_outputs={"choice": []}), 400, "structured_outputs.choice"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), 400,
     "structured_outputs"),
    ("/v1/completions", completion(structured_outputs={"regex": "("}), 400, "structured_outputs.regex"),
    ("/v1/completions", completion(structured_outputs={"json": {}}), 400, "structured_outputs.json"),
    ("/v1/chat/completions", chat(tools=[tool("f", {f"p{i}": {"type": "integer"} for i in range(16)})]), 400,
     "tools.0.function.parameters"),
    ("/v1/chat/completions", chat(tools=[tool("f", {"a": {"type": "nope"}})]), 400, "tools.0.function.parameters"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]), 400, "tools.0.function.parameters"),
    ("/v1/chat/completions", chat(tools=[tool("f b", {})]), 400, "tools.0.function.name"),
    ("/v1/chat/completions", chat(tools=[TOOL, TOOL]), 400, "tools.1.function.name"),
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice.function.name"),
    ("/v1/chat/completions", chat(tools=[TOOL], response_format={"type": "json_object"}), 400, "response_format"),
    ("/v1/chat/completions", chat(messages=[{"role": "tool", "content": "5"}]), 400, "messages.0.tool_call_id"),
    ("/v1/chat/completions", chat(messages=[*CHAT, {"role": "tool", "content": "5", "tool_call_id": "c1"}]), 400,
     "messages.1.tool_call_id"),
    ("/v1/chat/completions", chat(messages=[{"role": "assistant", "content": None}]), 400, "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages.0.tool_calls"),
    ("/v1/chat/completions", chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("/v1/chat/completions", chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/chat/completions", chat(priority=9), 400, "priority"),
    ("/v1/chat/completions", chat(users="me"), 400, "users"),
    ("/v1/completions", {"model": M}, 400, "prompt"),
    ("/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("/v1/completions", completion(error_behavior="ignore"), 400, "error_behavior"),
    ("/v1/completions", completion(logprobs=21), 400, "logprobs"),
    ("/v1/completions", completion(echo="yes"), 400, "echo"),
    ("/v1/completions", completion(model="not-served"), 404, "model"),
    ("/v1/embeddings", {}, 400, "input"),
    ("/v1/embeddings", {"input": [""]}, 400, "input"),
    ("/v1/embeddings", {"input": "x", "model": "not-served"}, 404, "model"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
]


def test_every_invalid_input_is_a_4xx_naming_the_field_then_serving_goes_on(base_url):
    assert len(CASES) >= 40
    with httpx.Client(base_url=f"{openai_apps()}/pd", timeout=60) as http:
        for path, body, status, field in CASES:
            if isinstance(body, bytes):
                response = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = http.post(path, json=body)
            assert response.status_code == status, (path, body if len(str(body)) < 200 else "...", response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            if field.startswith("code:"):
                assert error["code"] == field[5:], (path, error)
            else:  # the field, or an element of it (input_id.0), not a message that merely contains its name
                assert error["param"] == field or error["param"].startswith(f"{field}."), (path, field, error)
        good = http.post("/infer_token", json=infer(max_new_tokens=3, details=True))
        assert good.status_code == 200 and good.json()["details"]["generated_tokens"] == 3
        good = http.post("/v1/chat/completions", json=chat(max_tokens=2))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


MINDIE_INFER_EXAMPLE = {  # seeds/000, verbatim
    "input_id": [5618, 19678, 701, 9072, 13], "stream": False,
    "parameters": {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True,
                   "seed": None, "repetition_penalty": 1.03, "details": True, "typical_p": 0.5, "watermark": False,
                   "priority": 5, "timeout": 10}}
MINDIE_CHAT_EXAMPLES = [  # seeds/001, verbatim: single and multi-turn
    {"model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "You are a helpful assistant."}],
     "max_tokens": 20, "presence_penalty": 1.03, "frequency_penalty": 1.0, "seed": None, "temperature": 0.5,
     "top_p": 0.95, "stream": False},
    {"model": "gpt-3.5-turbo", "messages": [{"role": "system", "content": "You are a student who is good at math."},
                                            {"role": "user", "content": "what is your hobby?"}],
     "max_tokens": 20, "presence_penalty": 1.03, "frequency_penalty": 1.0, "seed": None, "temperature": 0.5,
     "top_p": 0.95, "stream": False},
]


def test_mindie_infer_token_example_text_and_stream(base_url):
    response = httpx.post(f"{base_url}/docs/infer_token", json=MINDIE_INFER_EXAMPLE, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"generated_text", "details"} and isinstance(body["generated_text"], str)
    assert body["details"]["finish_reason"] in ("eos_token", "length", "stop_sequence")
    assert 1 <= body["details"]["generated_tokens"] <= 20 and body["details"]["seed"] > 0
    streamed = httpx.post(f"{base_url}/docs/infer_token", json={**MINDIE_INFER_EXAMPLE, "stream": True}, timeout=60)
    events = sse_events(streamed)
    assert set(events[0]) == {"prefill_time", "decode_time", "token"} and events[0]["decode_time"] is None
    assert all(set(e["token"]) == {"id", "text"} for e in events)
    assert set(events[-1]) == {"prefill_time", "decode_time", "token", "generated_text", "details"}
    assert len(events) == events[-1]["details"]["generated_tokens"]


@pytest.mark.parametrize("example", MINDIE_CHAT_EXAMPLES)
def test_mindie_chat_examples(base_url, example):
    response = httpx.post(f"{base_url}/docs/v1/chat/completions", json=example, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "gpt-3.5-turbo"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["index"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["usage"]["completion_tokens"] <= 20


def test_deadline_before_the_first_token_is_a_408(base_url):
    blocker = {"input_id": list(range(3, 800)) * 4, "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: httpx.post(f"{base_url}/busy/infer_token", json=blocker, timeout=120))
    thread.start()
    try:
        handle = serve.get_deployment_handle("LLMServer", app_name="busy")
        assert wait_until(lambda: handle.stats.remote().result().running == 1, 30)
        late = httpx.post(f"{base_url}/busy/infer_token", json=infer(timeout=1), timeout=60)
        assert late.status_code == 408, late.text
        assert late.json()["error"]["param"] == "timeout"
    finally:
        thread.join(timeout=120)
    after = httpx.post(f"{base_url}/busy/infer_token", json=infer(details=True, ignore_eos=True), timeout=60)
    assert after.json()["details"]["generated_tokens"] == 20
