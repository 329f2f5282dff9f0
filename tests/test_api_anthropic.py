"""Anthropic's Messages API as the anthropic SDK speaks it, unmodified, against the PD app:
``messages.create``, ``messages.stream``, ``messages.count_tokens``, stop sequences, a forced
``tool_use`` whose input validates and its ``tool_result`` sent back, and errors in Anthropic's
shape. Each answer is checked against chat's answer to the same conversation: the two are one
internal request.

The app runs in float32: greedy answers are compared token for token.
"""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.serving import AGENT_APP_CAP, agents_app

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
CAP = AGENT_APP_CAP  # max_iter_times of the agents app
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "Grüße, wie geht's?"}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY_SCHEMA}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
# The SDK (2.13) no longer declares the sampling controls; the API takes them, sent as extra body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def base_url():
    return agents_app()


def client(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def chat_choice(base_url, max_tokens: int, **fields):
    """Chat's greedy answer to the same conversation."""
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    return c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *ASK],
                                     max_tokens=max_tokens, temperature=0, **fields)


def test_create_is_chats_answer(base_url):
    message = client(base_url).messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=8,
                                               extra_body=GREEDY)
    chat = chat_choice(base_url, 8)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == STOP_REASONS[chat.choices[0].finish_reason]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_stream_events_and_text_match_create(base_url):
    c = client(base_url)
    whole = c.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY)
    with c.messages.stream(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    raw = [k for k in kinds if k not in ("text", "ping")]  # the SDK adds "text" events beside each delta
    deltas = raw.count("content_block_delta")
    assert deltas >= 1
    assert raw == ["message_start", "content_block_start", *["content_block_delta"] * deltas, "content_block_stop",
                   "message_delta", "message_stop"]


def test_count_tokens_is_the_prompt_create_uses(base_url):
    c = client(base_url)
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK, tools=[WEATHER_TOOL])
    message = c.messages.create(model=MODEL, system=SYSTEM, messages=ASK, tools=[WEATHER_TOOL], max_tokens=1,
                                tool_choice={"type": "none"})
    without_tools = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert without_tools.input_tokens < counted.input_tokens  # the tools are in the template
    assert c.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=1).usage.input_tokens == \
        without_tools.input_tokens
    assert message.usage.input_tokens == without_tools.input_tokens  # tool_choice none hides the tools


def test_stop_sequence_cuts_and_is_named(base_url):
    c = client(base_url)
    text = c.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY).content[0].text
    stop = text.strip()[3:6]
    assert len(stop) == 3, text  # the greedy answer is long enough to cut
    cut = c.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY,
                            stop_sequences=["\x00", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_forced_tool_use_validates_and_its_result_goes_back(base_url):
    c = client(base_url)
    message = c.messages.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                                max_tokens=CAP, extra_body=GREEDY)
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY_SCHEMA)
    answer = c.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}]}])
    assert answer.usage.input_tokens > message.usage.input_tokens  # the call and its result are in the prompt
    with c.messages.stream(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}],
                           tools=[WEATHER_TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           max_tokens=CAP, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY_SCHEMA)


def test_output_config_format_validates(base_url):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    message = client(base_url).messages.create(model=MODEL, messages=ASK, max_tokens=CAP,
                                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_errors_take_anthropics_shape(base_url):
    c = client(base_url)
    with pytest.raises(anthropic.NotFoundError) as caught:
        c.messages.create(model="claude-sonnet-4-5", messages=ASK, max_tokens=4)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith("messages.0.content.0.type:")
    for body in ({"model": MODEL, "messages": ASK}, {"model": MODEL, "messages": ASK, "max_tokens": CAP + 1},
                 {"model": MODEL, "messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled",
                                                                                 "budget_tokens": 1024}}):
        response = httpx.post(f"{base_url}/v1/messages", json=body, timeout=60,
                              headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"})
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_thinking_is_refused_by_name_where_the_model_does_not_reason(base_url):
    """tiny-llama's template has no <think>: enabled is a 400 naming thinking, disabled changes
    nothing; adaptive and a budget not below max_tokens are refused by name on any model
    (tests/test_anthropic_thinking.py has thinking on a reasoning model)."""
    c = client(base_url)
    with pytest.raises(anthropic.BadRequestError) as caught:
        c.messages.create(model=MODEL, messages=ASK, max_tokens=CAP, thinking={"type": "enabled", "budget_tokens": 4})
    assert caught.value.body["error"]["message"].startswith("thinking: the served model does not reason")
    for thinking, field in (({"type": "adaptive"}, "thinking.type"),
                            ({"type": "enabled", "budget_tokens": CAP}, "thinking.budget_tokens")):
        response = httpx.post(f"{base_url}/v1/messages", timeout=60, headers={"x-api-key": "unused"},
                              json={"model": MODEL, "messages": ASK, "max_tokens": CAP, "thinking": thinking})
        assert response.status_code == 400 and response.json()["error"]["message"].startswith(field), response.text
    plain = c.messages.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=GREEDY)
    disabled = c.messages.create(model=MODEL, messages=ASK, max_tokens=4, thinking={"type": "disabled"},
                                 extra_body=GREEDY)
    assert disabled.content == plain.content and disabled.usage == plain.usage

