"""Structured output and tool calls over HTTP, on the PD and colocated apps, through the clients
people use: openai (``parse``, pydantic function tools), LangChain (``with_structured_output``,
``bind_tools``)."""

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from engine.execution.tiny_model import ensure_tiny_model
from tests.serving import OPENAI_APPS_CAP, openai_apps

MODEL = "tiny-llama"
CAP = OPENAI_APPS_CAP  # max_iter_times of the kept OpenAI pair
APPS = ["pd", "co"]


@pytest.fixture(scope="module")
def base_url():
    return openai_apps()


def client(base_url, app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="unused", max_retries=0)


def chat_model(base_url, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{base_url}/pd/v1", api_key="unused", max_tokens=CAP, **kwargs)



class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)
    name: str = pydantic.Field(max_length=10)


PET_SCHEMA = {**Pet.model_json_schema(), "additionalProperties": False}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "strict": True, "schema": PET_SCHEMA}}
ASK = [{"role": "user", "content": "A pet, as JSON."}]


@pytest.mark.parametrize("app", APPS)
def test_openai_parse_returns_the_pydantic_model(base_url, app):
    c = client(base_url, app)
    for seed in (1, 2, 3):
        completion = c.chat.completions.parse(model=MODEL, messages=ASK, response_format=Pet, seed=seed,
                                              max_completion_tokens=CAP)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop" and isinstance(message.parsed, Pet), message.content


def test_structured_output_is_the_same_in_pd_colocated_and_streamed(base_url):
    answers = {}
    for app in APPS:
        for stream in (False, True):
            created = client(base_url, app).chat.completions.create(
                model=MODEL, messages=ASK, response_format=PET_FORMAT, seed=11, max_completion_tokens=CAP,
                n=2, stream=stream)
            if stream:
                texts = {0: "", 1: ""}
                for chunk in created:
                    for choice in chunk.choices:
                        texts[choice.index] += choice.delta.content or ""
                answers[app, stream] = [texts[0], texts[1]]
            else:
                answers[app, stream] = [choice.message.content for choice in created.choices]
    assert len(set(map(tuple, answers.values()))) == 1, answers
    for text in answers["pd", False]:
        jsonschema.validate(json.loads(text), PET_SCHEMA)


def test_langchain_with_structured_output_by_json_schema(base_url):
    pet = chat_model(base_url, seed=5).with_structured_output(Pet, method="json_schema").invoke("A pet, as JSON.")
    assert isinstance(pet, Pet)


def test_regex_and_choice_extensions_on_chat_and_completions(base_url):
    for app in APPS:
        c = client(base_url, app)
        chat = c.chat.completions.create(model=MODEL, messages=ASK, seed=3, max_completion_tokens=CAP,
                                         extra_body={"structured_outputs": {"choice": ["cat", "dog", "Köln"]}})
        assert chat.choices[0].message.content in ("cat", "dog", "Köln")
        assert chat.choices[0].finish_reason == "stop"
        done = c.completions.create(model=MODEL, prompt="Order no. ", seed=4, max_tokens=CAP, n=3,
                                    extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}})
        assert all(re.fullmatch(r"[A-Z]{2}-[0-9]{4}", choice.text) for choice in done.choices), done
    with pytest.raises(openai.BadRequestError) as error:
        client(base_url, "pd").completions.create(model=MODEL, prompt="x", extra_body={
            "structured_outputs": {"regex": r"[^\s\S]"}})
    assert error.value.body["param"] == "structured_outputs.regex"


# ---- tool calls ----------------------------------------------------------------------------


class Add(pydantic.BaseModel):
    """Add two small numbers."""

    a: int = pydantic.Field(ge=0, le=99)
    b: int = pydantic.Field(ge=0, le=99)


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=12)
    unit: Literal["c", "f"]


def function_tool(name: str, model: type[pydantic.BaseModel]) -> dict:
    # The fields in the order the server lists them, so that the test's own rendering of the
    # template is the server's (test_multi_turn_tool_use_is_templated).
    return {"type": "function", "function": {"name": name, "description": model.__doc__, "parameters": {
        **model.model_json_schema(), "additionalProperties": False}}}


TOOLS = [function_tool("add", Add), function_tool("get_weather", Weather)]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK_TOOL = [{"role": "user", "content": "2 + 3, and the weather in Köln?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def calls_of(created, stream: bool) -> list[list[tuple[str, str]]]:
    """Each choice's calls as (name, arguments), streamed deltas reassembled; checks the shapes."""
    if not stream:
        assert all(c.finish_reason == "tool_calls" and c.message.content is None for c in created.choices)
        return [[(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in created.choices]
    calls: dict[int, dict[int, list]] = {}
    finish = {}
    for chunk in created:
        for choice in chunk.choices:
            assert not choice.delta.content
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:  # a call's first delta: id, type and the whole name
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    calls.setdefault(choice.index, {})[delta.index] = [delta.function.name, ""]
                calls[choice.index][delta.index][1] += delta.function.arguments or ""
    assert set(finish.values()) == {"tool_calls"}
    return [[tuple(calls[i][j]) for j in sorted(calls[i])] for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_tool_calls_are_valid_and_the_same_in_pd_colocated_and_streamed(base_url, tool_choice):
    answers = {}
    for app in APPS:
        for stream in (False, True):
            answers[app, stream] = [calls_of(client(base_url, app).chat.completions.create(
                model=MODEL, messages=ASK_TOOL, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                seed=seed, n=2, max_completion_tokens=CAP, stream=stream), stream) for seed in (1, 2, 3)]
    assert len({json.dumps(a) for a in answers.values()}) == 1, answers
    for per_seed in answers["pd", False]:
        for calls in per_seed:
            assert len(calls) == 1  # parallel_tool_calls false
            name, arguments = calls[0]
            assert name == "get_weather" if tool_choice == NAMED else name in SCHEMAS
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_multi_turn_tool_use_is_templated(base_url):
    c = client(base_url, "pd")
    first = c.chat.completions.create(model=MODEL, messages=ASK_TOOL, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, seed=4, max_completion_tokens=CAP)
    message = first.choices[0].message
    call = message.tool_calls[0]
    answer = {"role": "tool", "tool_call_id": call.id, "content": "5"}
    # The assistant's message goes back as the openai client sends it; tool_choice "auto".
    second = c.chat.completions.create(model=MODEL, messages=[*ASK_TOOL, message, answer], tools=TOOLS, seed=5,
                                       max_completion_tokens=4)
    assert isinstance(second.choices[0].message.content, str) and second.choices[0].message.tool_calls is None
    templated = {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    text = tokenizer.apply_chat_template([*ASK_TOOL, templated, answer], tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False)
    assert f"<tool_call>\n{{\"name\": \"{call.function.name}\"" in text and "<|tool|>\n5" in text
    assert second.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_openai_parse_with_pydantic_function_tools(base_url):
    tools = [openai.pydantic_function_tool(Add), openai.pydantic_function_tool(Weather)]
    for seed in (1, 2):
        completion = client(base_url, "pd").chat.completions.parse(
            model=MODEL, messages=ASK_TOOL, tools=tools, tool_choice="required", parallel_tool_calls=False,
            seed=seed, max_completion_tokens=CAP)
        parsed = [call.function.parsed_arguments for call in completion.choices[0].message.tool_calls or []]
        assert parsed and all(isinstance(p, (Add, Weather)) for p in parsed), completion


def test_langchain_bind_tools_invoke_and_stream_agree(base_url):
    for tool_choice in ("Add", "any"):  # a tool's name, and LangChain's word for "required"
        chat = chat_model(base_url, seed=6).bind_tools([Add, Weather], tool_choice=tool_choice,
                                                      parallel_tool_calls=False)
        message = chat.invoke("2 + 3?")
        chunks = list(chat.stream("2 + 3?"))
        streamed = chunks[0]
        for chunk in chunks[1:]:
            streamed += chunk
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"])
                                                                        for c in message.tool_calls]
        assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] in ("Add", "Weather")
        {"Add": Add, "Weather": Weather}[message.tool_calls[0]["name"]].model_validate(message.tool_calls[0]["args"])
        assert tool_choice == "any" or message.tool_calls[0]["name"] == "Add"


def test_langchain_with_structured_output_by_function_calling(base_url):
    # strict: LangChain closes the schema (no extra properties), which the constrained call then follows.
    pet = chat_model(base_url, seed=7).with_structured_output(Pet, method="function_calling", strict=True).invoke(
        "A pet.")
    assert isinstance(pet, Pet)
