"""Tool calls without a server: the grammar (what it lets through and what it refuses), the
parser and the stream deltas, and, through the chat frontend and the engine (one engine, and P
then D), a valid call for every seed."""

import json
import time

import jsonschema
import pytest
from transformers import AutoTokenizer

from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.tool_calls import ToolCallStream, parse_tool_calls, tools_grammar
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import STOP
from engine.execution.tiny_model import ensure_tiny_model

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
FUNCTIONS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in FUNCTIONS.items()]
SEEDS = range(1, 21)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny-llama"))


def matches(engine, grammar, text: str) -> bool:
    """Whether the grammar lets the tiny model write ``text`` (and nothing but EOS may then follow
    only if it is complete: that is not asked here)."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    try:
        engine.grammars.matcher(grammar, ids)
        return True
    except ValueError:
        return False


def test_auto_lets_text_through_and_constrains_a_call_once_it_begins(engine):
    auto = tools_grammar(FUNCTIONS, "auto", parallel=True)
    assert matches(engine, auto, "Sunny today, no tool needed. <tool")
    assert matches(engine, auto, "Let me add. " + CALL + "\n" + CALL)
    assert not matches(engine, auto, "<tool_call>\n{\"name\": \"mul\"")  # no such tool
    assert not matches(engine, auto, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": \"x\"")  # not an integer
    assert not matches(engine, auto, "<tool_call>\n{\"arguments\"")  # the name comes first
    assert not matches(engine, auto, "<tool_call>no newline")
    assert not matches(engine, auto, CALL + " and then text")
    single = tools_grammar(FUNCTIONS, "auto", parallel=False)
    assert matches(engine, single, CALL) and not matches(engine, single, CALL + "\n<tool_call>")


def test_required_and_named_allow_calls_only(engine):
    required = tools_grammar(FUNCTIONS, "required", parallel=True)
    assert not matches(engine, required, "Sure")
    assert matches(engine, required, CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"')
    named = tools_grammar(FUNCTIONS, "get_weather", parallel=True)
    assert not matches(engine, named, CALL) and matches(engine, named, '<tool_call>\n{"name": "get_weather"')


def test_references_resolve_inside_each_functions_schema(engine):
    # As pydantic writes a nested model: "$defs" at the parameters' root, "$ref"s to it.
    nested = {"$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                  "additionalProperties": False}},
              "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"]}
    grammar = tools_grammar({**FUNCTIONS, "move": nested}, "required", parallel=True)
    assert matches(engine, grammar, '<tool_call>\n{"name": "move", "arguments": {"at": {"x": 3}}}\n</tool_call>')
    assert not matches(engine, grammar, '<tool_call>\n{"name": "move", "arguments": {"at": {"x": "a"')
    assert matches(engine, grammar, CALL)  # the other functions still follow their own schemas


def test_parser_and_stream_deltas_agree_at_every_split():
    text = 'Let me see: <tool_c' + 'all>\n{"name": "add", "arguments": {"a": "}\\"{", "b": [1, {"c": 2}]}}' + \
        '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kö'
    content, calls = parse_tool_calls(text)
    assert content == "Let me see: " and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": '}"{', "b": [1, {"c": 2}]} and calls[0].complete
    assert calls[1].arguments == '{"city": "Kö' and not calls[1].complete
    for size in range(1, 8):
        stream, deltas = ToolCallStream(), []
        for start in range(0, len(text), size):
            deltas += stream.feed(text[start:start + size], finished=False)
            sent = "".join(d.get("content", "") for d in deltas)
            assert "<" not in sent  # the tag's beginning is held back, never sent as content
        assert "".join(d.get("content", "") for d in deltas) == content
        first = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
        assert [(c["index"], c["function"]["name"]) for c in first] == [(0, "add"), (1, "get_weather")]
        arguments = ["", ""]
        for d in deltas:
            for call in d.get("tool_calls", []):
                arguments[call["index"]] += call["function"]["arguments"]
        assert arguments == [calls[0].arguments, calls[1].arguments]


def test_text_that_only_looks_like_a_tag_is_flushed_at_the_end():
    stream = ToolCallStream()
    assert stream.feed("a <tool", finished=False) == [{"content": "a "}]
    assert stream.feed("", finished=True) == [{"content": "<tool"}] and not stream.called


@pytest.fixture(scope="module")
def front(engine):
    return OpenAIFrontend(engine.tokenizer, "tiny-llama", engine.vocab_size, 4096, 256)


def chat_request(front, seed, **fields):
    body = ChatCompletionRequest.model_validate({
        "model": "tiny-llama", "messages": [{"role": "user", "content": "Weather in Köln, and 2 + 3?"}],
        "tools": TOOLS, "seed": seed, "max_tokens": 120, **fields})
    return front.chat_choices(body, f"r{seed}", time.time() + 600)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_valid_call_for_every_seed(engine, front, tool_choice):
    choices = [chat_request(front, seed, tool_choice=tool_choice, parallel_tool_calls=False)[0] for seed in SEEDS]
    outputs = engine.generate([c.request for c in choices])
    names = set()
    for choice in choices:
        choice.outputs = [outputs[choice.request.request_id]]
        assert choice.final.finish_reason == STOP, choice.final.text  # the grammar completed
        message, called = front.chat_message(choice)
        assert called and message["content"] is None and len(message["tool_calls"]) == 1
        call = message["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), FUNCTIONS[call["name"]])
        names.add(call["name"])
    assert names == {"add"} if isinstance(tool_choice, dict) else names <= set(FUNCTIONS)


def test_a_named_choice_makes_exactly_one_call_for_every_seed(engine, front):
    """As OpenAI and vLLM: a named function is called once, then the output ends ("tool_calls"),
    with parallel_tool_calls left at its default (true)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [chat_request(front, seed, tool_choice=named)[0] for seed in SEEDS]
    outputs = engine.generate([c.request for c in choices])
    for choice in choices:
        choice.outputs = [outputs[choice.request.request_id]]
        message, called = front.chat_message(choice)
        assert called and len(message["tool_calls"]) == 1, choice.final.text
        assert front.finish_reason(choice.final, called=called) == "tool_calls"
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)


def test_prefill_and_decode_equal_one_engine(engine, front):
    p, d = LLMEngine(EngineConfig(model="tiny-llama")), LLMEngine(EngineConfig(model="tiny-llama"))
    for seed in range(1, 6):
        request = chat_request(front, seed, tool_choice="required")[0].request
        alone = engine.generate([request])[request.request_id]
        prefill = p.prefill([request])[request.request_id]
        decoded = d.decode([(request, prefill.prefill)])[request.request_id]
        assert decoded.output_token_ids == alone.output_token_ids and alone.text.startswith("<tool_call>\n")


def test_auto_needs_a_template_with_the_tool_syntax(engine):
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain = OpenAIFrontend(tokenizer, "tiny-llama", engine.vocab_size, 4096, 256)
    with pytest.raises(APIError) as error:
        chat_request(plain, 1)
    assert error.value.status == 400 and error.value.param == "tool_choice"
    assert chat_request(plain, 1, tool_choice="required")  # a constrained call needs no template syntax


def test_tools_reach_the_template_only_when_they_may_be_called(front):
    tokenizer = front.tokenizer
    shown = tokenizer.decode(chat_request(front, 1)[0].request.prompt_token_ids)
    hidden = tokenizer.decode(chat_request(front, 1, tool_choice="none")[0].request.prompt_token_ids)
    assert '"name": "get_weather"' in shown and "get_weather" not in hidden
