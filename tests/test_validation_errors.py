"""What a schema's refusal becomes, without a server: the dialects' own request schemas behind a
FastAPI app with the handler the served app installs (dialects/errors.py ``on_validation_error``):
400, the field named as a dotted path in ``param`` and at the start of the message, whole-body
errors by code. tests/test_api_validation.py sends the same kinds of body to the served routes;
this one reaches each branch of the handler in milliseconds (and in ``make mutants``)."""

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from dialects.errors import on_validation_error
from dialects.mindie import InferTokenRequest
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest

app = FastAPI()
app.add_exception_handler(RequestValidationError, on_validation_error)


@app.post("/chat")
async def chat(body: ChatCompletionRequest) -> dict:
    return {}


@app.post("/completions")
async def completions(body: CompletionRequest) -> dict:
    return {}


@app.post("/infer_token")
async def infer_token(body: InferTokenRequest) -> dict:
    return {}


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def post(path: str, body) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            if isinstance(body, bytes):
                return await client.post(path, content=body, headers={"content-type": "application/json"})
            return await client.post(path, json=body)

    return asyncio.run(send())


def error_of(path: str, body) -> dict:
    response = post(path, body)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_valid_body_passes():
    assert post("/chat", CHAT).status_code == 200
    assert post("/infer_token", {"input_id": [1, 2]}).status_code == 200


@pytest.mark.parametrize("body, code, message", [
    (b"{not json", "invalid_json", "the body is not valid JSON"),
    (b"", "missing_body", "the body is empty; a JSON object is required")])
def test_a_body_that_is_not_a_json_object_is_named_by_its_code(body, code, message):
    error = error_of("/infer_token", body)
    assert error == {"message": message, "type": "invalid_request_error", "param": None, "code": code}


@pytest.mark.parametrize("path, body, param", [
    ("/infer_token", {"input_id": [1.5]}, "input_id.0"),
    ("/infer_token", {"input_id": [5], "parameters": {"temperature": 0}}, "parameters.temperature"),
    ("/infer_token", {"input_id": [5], "parameters": {"foo": 1}}, "parameters.foo"),
    ("/chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/chat", {**CHAT, "temperature": 2.5}, "temperature"),
])
def test_a_field_is_named_by_its_dotted_path_in_param_and_message(path, body, param):
    error = error_of(path, body)
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    assert error["code"] not in (None, "invalid_value")  # pydantic's own error type, e.g. greater_than


def test_a_union_that_matches_no_form_says_why_for_each():
    error = error_of("/completions", {"model": "m", "prompt": {"a": 1}})
    assert error["param"] == "prompt"
    assert error["message"].startswith("prompt: matches none of its accepted forms: ")
    reasons = error["message"].removeprefix("prompt: matches none of its accepted forms: ").split("; ")
    assert len(reasons) >= 2 and all(reasons)  # one reason per form, each said


@pytest.mark.parametrize("body, param", [
    # a message's own check names its field relative to the message: the path is prefixed once
    ({**CHAT, "messages": [{"role": "tool", "content": "5"}]}, "messages.0.tool_call_id"),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}]}, "messages.0.tool_calls"),
    ({**CHAT, "response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema"),
    # a check that names the field it ran on is not prefixed again; one on the whole body has no prefix
    ({**CHAT, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({**CHAT, "min_tokens": 2, "stop": ["x"]}, "min_tokens"),
])
def test_a_check_across_fields_names_its_field_from_the_top(body, param):
    error = error_of("/chat", body)
    assert error["param"] == param and error["code"] == "invalid_value"
    assert error["message"].startswith(f"{param}: ") and "Value error" not in error["message"]
