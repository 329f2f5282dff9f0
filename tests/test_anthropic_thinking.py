"""Anthropic's extended thinking with the anthropic SDK, unmodified, on a reasoning model: a tiny
random Qwen3 with the Qwen3 thinking models' template (the generation prompt opens ``<think>``).
The SDK talks to the real /v1/messages route in process (tests/inprocess_app.py: the ingress's
route body, its error handlers in Anthropic's shape, the engine client, an AsyncEngine behind
them), so no Ray app is started; tests/test_api_anthropic.py has the served app's refusals of
``thinking``.

A random model never ends its thinking by itself: budget_tokens ends it, which is what is tested.
The engine is float32 and every request is seeded, so create and stream are compared exactly."""

import shutil

import anthropic
import httpx2  # the anthropic SDK's HTTP client (pinned with it in requirements.lock)
import pytest

from deployments.config import AppArgs
from dialects.anthropic import chat_request
from dialects.anthropic_schema import MessagesRequest
from dialects.reasoning import THINK_END
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.inprocess_app import InProcessApp
from tests.test_reasoning import TEMPLATE, use_template
from tests.test_reasoning_grammar import THINKING_TEMPLATE, long_qwen3

CAP = 64
BUDGET = 8
MODEL = "tiny-qwen3"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
THINK = {"type": "enabled", "budget_tokens": BUDGET}


def client_of(app: InProcessApp) -> anthropic.Anthropic:
    """An anthropic client whose requests ``app``'s routes answer."""
    return anthropic.Anthropic(base_url="http://in-process", api_key="unused", max_retries=0,
                               http_client=httpx2.Client(transport=app.transport(httpx2)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return use_template(long_qwen3(tmp_path_factory.mktemp("qwen3") / MODEL), THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def thinker(model_dir):
    """The routes over the model, and an anthropic client that sends to them."""
    app = InProcessApp(AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", max_iter_times=CAP,
                                                torch_threads=1)),
                       AppArgs(model=str(model_dir), served_model_name=MODEL))
    yield app, client_of(app)
    app.close()


def create(client, **fields):
    return client.messages.create(model=MODEL, messages=ASK, max_tokens=CAP, extra_body={"seed": 7},
                                  **fields)


def test_thinking_comes_back_as_a_block_ended_by_the_budget(thinker):
    app, client = thinker
    message = create(client, thinking=THINK)
    assert [b.type for b in message.content] == ["thinking", "text"], message.content
    thinking, text = message.content
    assert thinking.thinking and thinking.signature and text.text
    # The budget ended the thinking: BUDGET tokens (one more or two where a UTF-8 character was
    # cut there), then </think>'s tokens; the whole output is thinking + </think> + text.
    tokens = app.frontend().tokenizer.encode
    tag = len(tokens(THINK_END, add_special_tokens=False))
    thought_tokens = len(tokens(thinking.thinking + THINK_END, add_special_tokens=False)) - tag
    assert message.usage.output_tokens > BUDGET + tag and thought_tokens <= BUDGET + 2, thinking.thinking


def test_the_stream_sends_thinking_deltas_and_a_signature_before_the_text(thinker):
    _, client = thinker
    whole = create(client, thinking=THINK)
    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=CAP, thinking=THINK,
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


def test_disabled_switches_the_templates_thinking_off(thinker, model_dir, tmp_path):
    """Qwen3's own template reads enable_thinking: disabled (and absent, Anthropic's default) writes
    its empty thinking into the prompt, and no thinking block comes back. The same engine, its
    tokenizer served with Qwen3's template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    own = InProcessApp(thinker[0].engine, AppArgs(model=str(model_dir), served_model_name=MODEL),
                       tokenizer_dir=use_template(tmp_path, TEMPLATE), owns_engine=False)
    try:
        front = own.frontend()
        assert "<think>" not in front.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True,
                                                                     enable_thinking=True)
        for thinking in ({"type": "disabled"}, None):
            body = MessagesRequest.model_validate({"model": MODEL, "messages": ASK, "max_tokens": 8,
                                                   **({"thinking": thinking} if thinking else {})})
            assert chat_request(body, front).chat_template_kwargs == {"enable_thinking": False}
        message = create(client_of(own), thinking={"type": "disabled"})
        assert all(b.type == "text" for b in message.content)
    finally:
        own.close()


def test_a_thinking_block_sent_back_is_the_turns_thinking(thinker):
    app, client = thinker
    first = create(client, thinking=THINK)
    turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
    front = app.frontend()
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, "messages": [*ASK, turn]})
    assistant = chat_request(body, front).messages[1]
    assert assistant.content == "<think>" + first.content[0].thinking + THINK_END + first.content[1].text
