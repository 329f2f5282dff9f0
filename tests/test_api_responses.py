"""OpenAI's Responses API as its clients speak it, unmodified, against the PD app: the openai SDK's
``responses.create`` (text, stream events, a function tool round trip through
previous_response_id, text.format json_schema) and an openai-agents Agent on its default
(Responses) model with a function tool. Each answer is checked against chat's answer to the same
conversation: the two are one internal request.

The app runs in float32: greedy answers are compared token for token.
"""

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from tests.serving import AGENT_APP_CAP, agents_app

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
CAP = AGENT_APP_CAP  # max_iter_times of the agents app
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": CITY_SCHEMA, "strict": True}


@pytest.fixture(scope="module")
def base_url():
    return agents_app()


def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def chat_text(base_url, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    """Chat's greedy answer to the same conversation, and its finish reason."""
    choice = client(base_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                      temperature=0).choices[0]
    return choice.message.content, choice.finish_reason


def test_text_is_chats_answer_and_is_kept(base_url):
    c = client(base_url)
    response = c.responses.create(model=MODEL, instructions="You are terse.", input="Grüße, wie geht's?",
                                  max_output_tokens=8, temperature=0)
    text, finish = chat_text(base_url, [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "Grüße, wie geht's?"}], 8)
    assert response.output_text == text
    assert response.status == ("incomplete" if finish == "length" else "completed")
    assert response.usage.output_tokens <= 8 and response.usage.total_tokens == \
        response.usage.input_tokens + response.usage.output_tokens
    kept = c.responses.retrieve(response.id)
    assert kept.id == response.id and kept.output_text == text


def test_stream_events_come_in_openai_order(base_url):
    c = client(base_url)
    whole = c.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=12, temperature=0)
    events = list(c.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=12, temperature=0,
                                     stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_function_tool_round_trip_through_previous_response_id(base_url):
    c = client(base_url)
    first = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                               tool_choice="required", parallel_tool_calls=False, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY_SCHEMA)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    second = c.responses.create(model=MODEL, previous_response_id=first.id, input=[answer], tools=[WEATHER_TOOL],
                                tool_choice="none", max_output_tokens=4, temperature=0)
    # The stored conversation is the one sent whole: the question, the call, and its output.
    stateless = c.responses.create(model=MODEL, input=[{"role": "user", "content": "What is the weather in Paris?"},
                                                       call.model_dump(exclude_none=True), answer],
                                   tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=4, temperature=0)
    question_only = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                       tool_choice="none", max_output_tokens=1)
    assert second.usage.input_tokens == stateless.usage.input_tokens > question_only.usage.input_tokens
    assert second.output_text == stateless.output_text
    assert second.previous_response_id == first.id
    with pytest.raises(openai.BadRequestError) as caught:  # without the first, the output answers no call
        c.responses.create(model=MODEL, input=[answer], max_output_tokens=4)
    assert caught.value.body["param"] == "input"


def test_streamed_function_call_arguments(base_url):
    events = list(client(base_url).responses.create(
        model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL], tool_choice={"type": "function",
                                                                                 "name": "get_weather"},
        parallel_tool_calls=False, temperature=0, stream=True, store=False))
    kinds = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert pieces and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                *["response.function_call_arguments.delta"] * len(pieces),
                                "response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(pieces) == done.arguments
    jsonschema.validate(json.loads(done.arguments), CITY_SCHEMA)
    with pytest.raises(openai.NotFoundError):  # store false: not kept
        client(base_url).responses.retrieve(events[-1].response.id)


def test_text_format_json_schema_validates(base_url):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    for seed in (1, 2):
        response = client(base_url).responses.create(
            model=MODEL, input="Is it raining?", extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"max_output_tokens": CAP + 1}, "max_output_tokens"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),  # tiny-llama does not reason
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": []}]}, "input.1"),
])
def test_what_is_not_offered_is_refused_by_name(base_url, fields, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == (404 if param == "previous_response_id" else 400)
    assert response.json()["error"]["param"] == param


def test_an_agent_calls_its_function_tool(base_url):
    """openai-agents, unmodified: its default model speaks the Responses API; the model's call runs
    the tool, whose result is the run's output."""
    import agents

    agents.set_tracing_disabled(True)  # nothing leaves this machine
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0),
                                     use_for_tracing=False)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=MODEL, tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             temperature=0),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=2))
    assert len(calls) == 1 and result.final_output == f"Sunny in {calls[0]}."
    (call,) = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert json.loads(call.arguments) == {"city": calls[0]}
