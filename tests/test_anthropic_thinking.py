"""Anthropic's extended thinking with the anthropic SDK, unmodified, on a reasoning model: a tiny
random Qwen3 with the Qwen3 thinking models' template (the generation prompt opens ``<think>``).
The SDK talks to the Messages dialect in-process (an httpx transport that runs what the ingress
runs for /v1/messages: dialects/anthropic.py's exchange, the chat request, the engine), so no Ray
app is started; tests/test_api_anthropic.py has the served app's refusals of ``thinking``.

A random model never ends its thinking by itself: budget_tokens ends it, which is what is tested.
The engine is float32 and every request is seeded, so create and stream are compared exactly."""

import json
import time

import anthropic
import httpx2  # the anthropic SDK's HTTP client (pinned with it in requirements.lock)
import pytest

from dialects.anthropic import MessagesExchange, chat_request, error_body
from dialects.anthropic_schema import MessagesRequest
from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.reasoning import THINK_END
from tests.test_reasoning import TEMPLATE, engine_with_template
from tests.test_reasoning_grammar import THINKING_TEMPLATE, long_qwen3

CAP = 64
BUDGET = 8
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
THINK = {"type": "enabled", "budget_tokens": BUDGET}


def served(engine, front):
    """An anthropic client whose requests the dialect and ``engine`` answer in-process."""

    def handle(http: httpx2.Request) -> httpx2.Response:
        try:
            body = MessagesRequest.model_validate(json.loads(http.content))
            exchange = MessagesExchange(body, front)
            (choice,) = front.chat_choices(exchange.chat, exchange.id, time.time() + 600)
        except APIError as error:
            return httpx2.Response(error.status, json=error_body(error.status, error.message))
        engine.add_request(choice.request)
        writer, events = exchange.writer([choice]), ""
        for _ in range(4 * CAP):  # bounded: one token a step, at most CAP of them
            for output in engine.step():
                choice.outputs.append(output)
                events += writer.write(0, output)
            if choice.outputs and choice.final.finished:
                break
        if body.stream:
            return httpx2.Response(200, text=events, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=exchange.response([choice]))

    return anthropic.Anthropic(base_url="http://in-process", api_key="unused", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handle)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return long_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")


@pytest.fixture(scope="module")
def thinker(model_dir):
    engine = engine_with_template(model_dir, THINKING_TEMPLATE)
    front = OpenAIFrontend(engine.tokenizer, "tiny-qwen3", engine.vocab_size, 1024, CAP)
    return engine, front, served(engine, front)


def create(client, **fields):
    return client.messages.create(model="tiny-qwen3", messages=ASK, max_tokens=CAP, extra_body={"seed": 7},
                                  **fields)


def test_thinking_comes_back_as_a_block_ended_by_the_budget(thinker):
    engine, _, client = thinker
    message = create(client, thinking=THINK)
    assert [b.type for b in message.content] == ["thinking", "text"], message.content
    thinking, text = message.content
    assert thinking.thinking and thinking.signature and text.text
    # The budget ended the thinking: BUDGET tokens (one more or two where a UTF-8 character was
    # cut there), then </think>'s tokens; the whole output is thinking + </think> + text.
    tag = len(engine.grammars.tokenizer().tokenize_str(THINK_END))
    thought_tokens = len(engine.grammars.tokenizer().tokenize_str(thinking.thinking + THINK_END)) - tag
    assert message.usage.output_tokens > BUDGET + tag and thought_tokens <= BUDGET + 2, thinking.thinking


def test_the_stream_sends_thinking_deltas_and_a_signature_before_the_text(thinker):
    _, _, client = thinker
    whole = create(client, thinking=THINK)
    with client.messages.stream(model="tiny-qwen3", messages=ASK, max_tokens=CAP, thinking=THINK,
                                extra_body={"seed": 7}) as stream:
        events = [e for e in stream if e.type.startswith("content_block")]
        final = stream.get_final_message()
    kinds = [(e.type, getattr(e, "delta", None) and e.delta.type) for e in events]
    first_text = kinds.index(("content_block_start", None), 1)
    assert kinds[0] == ("content_block_start", None) and events[0].content_block.type == "thinking"
    assert ("content_block_delta", "thinking_delta") in kinds[:first_text]
    signed = [("content_block_delta", "signature_delta"), ("content_block_stop", None)]
    assert kinds[first_text - 2:first_text] == signed
    assert events[first_text].content_block.type == "text"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]


def test_disabled_switches_the_templates_thinking_off(model_dir):
    """Qwen3's own template reads enable_thinking: disabled (and absent, Anthropic's default) writes
    its empty thinking into the prompt, and no thinking block comes back."""
    engine = engine_with_template(model_dir, TEMPLATE)
    front = OpenAIFrontend(engine.tokenizer, "tiny-qwen3", engine.vocab_size, 1024, CAP)
    for thinking in ({"type": "disabled"}, None):
        body = MessagesRequest.model_validate({"model": "tiny-qwen3", "messages": ASK, "max_tokens": 8,
                                               **({"thinking": thinking} if thinking else {})})
        assert chat_request(body, front).chat_template_kwargs == {"enable_thinking": False}
    message = create(served(engine, front), thinking={"type": "disabled"})
    assert all(b.type == "text" for b in message.content)


def test_a_thinking_block_sent_back_is_the_turns_thinking(thinker):
    _, front, client = thinker
    first = create(client, thinking=THINK)
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    body = MessagesRequest.model_validate({"model": "tiny-qwen3", "max_tokens": 8, "messages": [*ASK, turn]})
    assistant = chat_request(body, front).messages[1]
    assert assistant.content == "<think>" + first.content[0].thinking + THINK_END + first.content[1].text
