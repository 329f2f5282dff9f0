"""Every dialect's control fields traced to the engine's request, without a model or a server.

One table (``ROWS``) says, for each route and each control field a user can send, which part of
the GenerationRequest it sets and to what; ``DEFAULTS`` says what each route sends when the field
is absent. Each route is driven through the public entry point its dialect's serving module calls: the
parsed body (as FastAPI parses it) into the engine's request(s). A schema field that neither
table nor ``NOT_CONTROLS`` names fails ``test_every_field_of_every_route_is_in_the_table``: a new
field or a new dialect adds rows here. Served behaviour of these fields is in the dialects' own
tests (test_api_*.py); this file is where a field that lands on the wrong control, or nowhere,
is caught.

``deadline`` is the request's absolute deadline: the arrival (``ARRIVAL``) plus the timeout the
dialect's request carries, as dialects/openai_serving.py and mindie_serving.py add them."""

from __future__ import annotations

from dataclasses import dataclass
import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
from transformers import AutoTokenizer

from dialects import databricks, mindie
from dialects.anthropic import MessagesExchange
from dialects.anthropic_schema import MessagesRequest
from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from dialects.responses import ResponsesExchange, ResponseStore
from dialects.responses_schema import ResponsesRequest
from engine.lora_adapter import LoraRef
from engine.execution.tiny_model import ensure_tiny_model
from engine.request import GenerationRequest

MODEL = "tiny-llama"
ADAPTER = LoraRef("sql-adapter", b"\x01" * 16)
MAX_ITER_TIMES = 64
ARRIVAL = 1_000_000.0
LIMITS = mindie.ServedLimits(vocab_size=891, max_output_tokens=MAX_ITER_TIMES, max_logits_floats=1 << 20,
                             max_beam_width=4, hidden_size=64, max_draft_tokens=8)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QWEN3_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def fronts() -> dict[str, OpenAIFrontend]:
    """tiny-llama's tokenizer with its own template ("plain") and with Qwen3's thinking template
    ("reasoning"): the reasoning fields need a template that reads them; no model is loaded."""
    plain = AutoTokenizer.from_pretrained(ensure_tiny_model())
    reasoning = AutoTokenizer.from_pretrained(ensure_tiny_model())
    reasoning.chat_template = QWEN3_TEMPLATE
    return {name: OpenAIFrontend(tokenizer, MODEL, len(tokenizer), 4096, MAX_ITER_TIMES,
                                 adapters={ADAPTER.name: ADAPTER})
            for name, tokenizer in (("plain", plain), ("reasoning", reasoning))}


# ---- each route: its minimal body, its schema, and its entry point -------------------------------


def infer_token(body: dict, front: OpenAIFrontend) -> list[GenerationRequest]:
    parsed = mindie.InferTokenRequest.model_validate(body)
    p = parsed.parameters
    lora = ADAPTER if p.lora_name == ADAPTER.name else None  # MindIEServing.lora resolves lora_name
    return [mindie.to_generation_request(parsed, "r", ARRIVAL + p.timeout, LIMITS, lora)]


def openai(schema: type, body: dict, front: OpenAIFrontend) -> list[GenerationRequest]:
    parsed = schema.model_validate(body)
    make = front.chat_choices if schema is ChatCompletionRequest else front.completion_choices
    choices = make(parsed, "r", ARRIVAL + parsed.timeout)
    return list({c.prompt_index: c.request for c in choices}.values())


def invocation(body: dict, front: OpenAIFrontend) -> list[GenerationRequest]:
    """Databricks' invocations route on the endpoint MODEL: the body's field picks the task."""
    task = databricks.task_of(body)
    parsed = databricks.parsed(body, task, MODEL)
    make = front.chat_choices if task == "messages" else front.completion_choices
    return list({c.prompt_index: c.request for c in make(parsed, "r", ARRIVAL + parsed.timeout)}.values())


def responses(body: dict, front: OpenAIFrontend) -> list[GenerationRequest]:
    exchange = ResponsesExchange(ResponsesRequest.model_validate(body), front, ResponseStore())
    return [front.chat_choices(exchange.chat, exchange.id, ARRIVAL + exchange.chat.timeout)[0].request]


def messages(body: dict, front: OpenAIFrontend) -> list[GenerationRequest]:
    exchange = MessagesExchange(MessagesRequest.model_validate(body), front)
    return [front.chat_choices(exchange.chat, exchange.id, ARRIVAL + exchange.chat.timeout)[0].request]


@dataclass(frozen=True)
class Route:
    base: dict  # the smallest body the route takes
    schema: type  # the body's schema (for /infer_token: its parameters)
    controls: str  # where control fields go: "" at the top, "parameters" in /infer_token
    engine_requests: Any  # (body, front) -> the engine's requests


USER = [{"role": "user", "content": "Hi"}]
ROUTES = {
    "infer_token": Route({"input_id": [5, 6, 7]}, mindie.InferParameters, "parameters", infer_token),
    "chat": Route({"model": MODEL, "messages": USER}, ChatCompletionRequest, "",
                  lambda b, f: openai(ChatCompletionRequest, b, f)),
    "completions": Route({"model": MODEL, "prompt": "Hi"}, CompletionRequest, "",
                         lambda b, f: openai(CompletionRequest, b, f)),
    # The token-id form of completions: ids go to the engine as they are.
    "completions_ids": Route({"model": MODEL, "prompt": [5, 6, 7]}, CompletionRequest, "",
                             lambda b, f: openai(CompletionRequest, b, f)),
    "responses": Route({"input": "Hi"}, ResponsesRequest, "", responses),
    "messages": Route({"model": MODEL, "messages": USER, "max_tokens": 16}, MessagesRequest, "", messages),
    # Databricks' POST /serving-endpoints/{name}/invocations: chat's and completions' bodies without model.
    "invocations_chat": Route({"messages": USER}, ChatCompletionRequest, "", invocation),
    "invocations_completions": Route({"prompt": "Hi"}, CompletionRequest, "", invocation),
}
OPENAI = ("chat", "completions", "completions_ids")
EVERY = tuple(ROUTES)
# Each row of chat and completions is one of the invocations route's too, bar a ``model`` naming an
# adapter (the endpoint names the model there: its own rows say what ``model`` does).
INVOCATIONS = {"invocations_chat": "chat", "invocations_completions": "completions"}


def body_with(route: str, fields: dict) -> dict:
    spec = ROUTES[route]
    body = json.loads(json.dumps(spec.base))
    (body.setdefault(spec.controls, {}) if spec.controls else body).update(fields)
    return body


def read(request: GenerationRequest, path: str) -> Any:
    """``request``'s value at a dotted path: "params.seed", "params.grammar.kind", "prompt_token_ids"."""
    value = request
    for part in path.split("."):
        value = getattr(value, part)
    return value


# ---- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    routes: tuple[str, ...]
    fields: dict  # the control fields sent (beside the route's base body)
    reads: dict[str, Any]  # engine request path -> the value it must hold
    front: str = "plain"


def tool(name: str = "weather") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": SCHEMA}}


ROWS = [
    # Scheduling: priority (vLLM's 0 is the default 5 on OpenAI's routes), timeout into the deadline.
    Row(EVERY, {"priority": 2}, {"priority": 2}),
    Row(OPENAI, {"priority": 0}, {"priority": 5}),
    Row(EVERY, {"timeout": 7}, {"deadline": ARRIVAL + 7}),
    # Sampling.
    Row(EVERY, {"seed": 1234}, {"params.seed": 1234}),
    Row(EVERY, {"temperature": 0.5}, {"params.temperature": 0.5}),
    Row(EVERY, {"top_k": 7}, {"params.top_k": 7}),
    Row(OPENAI, {"top_k": -1}, {"params.top_k": 0}),  # vLLM's "off"
    Row(EVERY, {"top_p": 0.75}, {"params.top_p": 0.75}),
    Row(OPENAI, {"min_p": 0.25}, {"params.min_p": 0.25}),
    Row(("infer_token",), {"do_sample": False}, {"params.do_sample": False}),
    Row(("infer_token",), {"do_sample": True}, {"params.do_sample": True}),
    # Penalties, biases and banned words.
    Row(OPENAI + ("infer_token",), {"repetition_penalty": 1.5}, {"params.repetition_penalty": 1.5}),
    Row(OPENAI + ("infer_token",), {"presence_penalty": 0.5}, {"params.presence_penalty": 0.5}),
    Row(OPENAI + ("infer_token",), {"frequency_penalty": -0.5}, {"params.frequency_penalty": -0.5}),
    Row(OPENAI, {"logit_bias": {"11": 5.0, "12": -100.0}}, {"params.logit_bias": {11: 5.0, 12: -100.0}}),
    Row(("infer_token",), {"embedding_bias": [0.0] * 3 + [2.5] + [0.0] * 887}, {"params.logit_bias": {3: 2.5}}),
    Row(("infer_token",), {"no_repeat_ngram_size": 3}, {"params.no_repeat_ngram_size": 3}),
    Row(("infer_token",), {"bad_words": [[9, 10], [11]]}, {"params.bad_words_ids": [[9, 10], [11]]}),
    # Output length and its ends.
    Row(OPENAI, {"max_tokens": 9}, {"params.max_new_tokens": 9}),
    Row(("chat",), {"max_completion_tokens": 8, "max_tokens": 9}, {"params.max_new_tokens": 8}),
    Row(("infer_token",), {"max_new_tokens": 9}, {"params.max_new_tokens": 9}),
    Row(("responses",), {"max_output_tokens": 9}, {"params.max_new_tokens": 9}),
    Row(("messages",), {"max_tokens": 9}, {"params.max_new_tokens": 9}),
    Row(OPENAI, {"min_tokens": 3}, {"params.min_new_tokens": 3}),
    Row(("infer_token",), {"min_length": 3}, {"params.min_new_tokens": 3}),
    Row(OPENAI, {"stop": "END"}, {"params.stop": ["END"]}),
    Row(OPENAI, {"stop": ["END", "STOP"]}, {"params.stop": ["END", "STOP"]}),
    Row(("messages",), {"stop_sequences": ["END"]}, {"params.stop": ["END"]}),
    Row(OPENAI, {"stop_token_ids": [11, 12]}, {"params.stop_token_ids": [[11], [12]]}),
    Row(("infer_token",), {"stop_words": [[11, 12]]}, {"params.stop_token_ids": [[11, 12]]}),
    Row(OPENAI, {"include_stop_str_in_output": True}, {"params.include_stop_str_in_output": True}),
    Row(OPENAI + ("infer_token",), {"ignore_eos": True}, {"params.ignore_eos": True}),
    Row(("infer_token",), {"end_id": 7}, {"params.eos_token_id": 7}),
    Row(OPENAI, {"skip_special_tokens": False}, {"params.skip_special_tokens": False}),
    # Choices and beams.
    Row(OPENAI, {"n": 3}, {"n": 3}),
    Row(("completions", "completions_ids"), {"n": 2, "best_of": 3}, {"n": 3, "params.logprobs": 0}),  # best_of ranks by logprob
    Row(("infer_token",), {"beam_width": 3, "length_penalty": 0.5, "early_stopping": "never"},
        {"params.beam_width": 3, "params.length_penalty": 0.5, "params.early_stopping": "never", "params.do_sample": None}),
    Row(("infer_token",), {"beam_width": 2, "early_stopping": 0},
        {"params.beam_width": 2, "params.early_stopping": False}),
    # Logprobs and logits.
    Row(("chat",), {"logprobs": True, "top_logprobs": 3}, {"params.logprobs": 3}),
    Row(("chat",), {"logprobs": True}, {"params.logprobs": 0}),
    Row(("completions", "completions_ids"), {"logprobs": 2}, {"params.logprobs": 2}),
    Row(("completions", "completions_ids"), {"logprobs": 2, "echo": True},
        {"params.logprobs": 2, "params.prompt_logprobs": 2}),
    Row(("completions", "completions_ids"), {"max_tokens": 0, "echo": True}, {"params.max_new_tokens": 1}),  # scores the prompt
    Row(("infer_token",), {"return_log_probs": True, "top_log_probs": 4}, {"params.logprobs": 4}),
    Row(("infer_token",), {"top_log_probs": 4}, {"params.logprobs": None}),  # needs return_log_probs
    Row(("infer_token",), {"return_context_logits": True, "return_generation_logits": True},
        {"params.return_context_logits": True, "params.return_generation_logits": True}),
    # Structured output, tools, reasoning.
    Row(("chat",), {"response_format": {"type": "json_object"}},
        {"params.grammar.kind": "json_object", "params.grammar.field": "response_format"}),
    Row(("chat",), {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}},
        {"params.grammar.kind": "json_schema", "params.grammar.text": json.dumps(SCHEMA, sort_keys=True)}),
    Row(("chat",), {"response_format": {"type": "text"}}, {"params.grammar": None}),
    Row(("responses",), {"text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}},
        {"params.grammar.kind": "json_schema", "params.grammar.text": json.dumps(SCHEMA, sort_keys=True)}),
    Row(("responses",), {"text": {"format": {"type": "json_object"}}}, {"params.grammar.kind": "json_object"}),
    Row(("messages",), {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
        {"params.grammar.kind": "json_schema", "params.grammar.text": json.dumps(SCHEMA, sort_keys=True)}),
    Row(OPENAI, {"structured_outputs": {"regex": "[0-9]+"}},
        {"params.grammar.kind": "regex", "params.grammar.text": "[0-9]+"}),
    Row(OPENAI, {"structured_outputs": {"choice": ["yes", "no"]}},
        {"params.grammar.kind": "lark", "params.grammar.text": 'start: "yes" | "no"\n'}),
    Row(("chat",), {"tools": [tool()], "tool_choice": "required"}, {"params.grammar.kind": "lark"}),
    Row(("chat",), {"tools": [tool()], "tool_choice": "none"}, {"params.grammar": None}),
    Row(("responses",), {"tools": [{"type": "function", "name": "weather", "parameters": SCHEMA}],
                         "tool_choice": "required"}, {"params.grammar.kind": "lark"}),
    Row(("messages",), {"tools": [{"name": "weather", "input_schema": SCHEMA}], "tool_choice": {"type": "any"}},
        {"params.grammar.kind": "lark"}),
    Row(("messages",), {"thinking": {"type": "enabled", "budget_tokens": 4}},
        {"params.grammar.kind": "text", "params.grammar.thinking_budget": 4}, front="reasoning"),
    # The prompt: the template's switches, truncation, raw prompts, LoRA, prompt lookup.
    Row(("chat",), {"truncate_prompt_tokens": 2}, {"prompt_token_ids.__len__": 2}),
    Row(("completions",), {"truncate_prompt_tokens": 2}, {"prompt_token_ids.__len__": 2}),
    Row(("completions_ids",), {"truncate_prompt_tokens": 2}, {"prompt_token_ids": [6, 7]}),
    Row(("completions",), {"use_raw_prompt": True}, {"prompt_token_ids.__len__": 2}),  # "Hi" without BOS
    Row(("completions_ids",), {"use_raw_prompt": True}, {"prompt_token_ids": [5, 6, 7]}),  # ids: never a BOS
    Row(OPENAI + ("messages",), {"model": ADAPTER.name}, {"lora": ADAPTER}),
    Row(("responses",), {"model": ADAPTER.name}, {"lora": ADAPTER}),
    Row(("infer_token",), {"lora_name": ADAPTER.name}, {"lora": ADAPTER}),
    Row(OPENAI + ("infer_token",), {"prompt_lookup": True}, {"prompt_lookup": True}),
    Row(OPENAI + ("infer_token",), {"prompt_lookup": False}, {"prompt_lookup": False}),
    Row(("infer_token",), {"draft_input_ids": [8, 9]}, {"draft.token_ids": [8, 9]}),
    Row(tuple(INVOCATIONS), {"model": MODEL}, {"lora": None}),  # the endpoint's own name: as without it
]


def routes_of(row: Row) -> tuple[str, ...]:
    """The routes ``row`` holds for: its own, and the invocations route's task of each."""
    shared = [inv for inv, base in INVOCATIONS.items() if base in row.routes and "model" not in row.fields]
    return tuple(dict.fromkeys(row.routes + tuple(shared)))

# What each route sends the engine when no control field is given.
COMMON_DEFAULTS = {
    "priority": 5, "deadline": ARRIVAL + 600, "n": 1, "lora": None, "prompt_lookup": None, "draft": None,
    "params.seed": None, "params.temperature": 1.0, "params.top_k": 0, "params.top_p": 1.0, "params.min_p": 0.0,
    "params.repetition_penalty": 1.0, "params.presence_penalty": 0.0, "params.frequency_penalty": 0.0,
    "params.logit_bias": {}, "params.stop": [], "params.stop_token_ids": [], "params.min_new_tokens": 0,
    "params.logprobs": None, "params.prompt_logprobs": None, "params.grammar": None, "params.beam_width": 1,
    "params.ignore_eos": False, "params.eos_token_id": None, "params.bad_words_ids": [],
    "params.no_repeat_ngram_size": 0, "params.include_stop_str_in_output": False,
    "params.skip_special_tokens": True, "params.do_sample": None,
}
DEFAULTS = {
    "infer_token": {**COMMON_DEFAULTS, "params.max_new_tokens": 20, "prompt_token_ids": [5, 6, 7]},
    "chat": {**COMMON_DEFAULTS, "params.max_new_tokens": MAX_ITER_TIMES},
    "completions": {**COMMON_DEFAULTS, "params.max_new_tokens": MAX_ITER_TIMES, "prompt_token_ids.__len__": 3},  # BOS, "H", "i"
    "completions_ids": {**COMMON_DEFAULTS, "params.max_new_tokens": MAX_ITER_TIMES, "prompt_token_ids": [5, 6, 7]},
    "responses": {**COMMON_DEFAULTS, "params.max_new_tokens": MAX_ITER_TIMES},
    "messages": {**COMMON_DEFAULTS, "params.max_new_tokens": 16},
}
DEFAULTS.update({inv: DEFAULTS[base] for inv, base in INVOCATIONS.items()})

# Schema fields that are not controls of the engine's request, each for a reason the dialect's
# own tests check: the input itself, the answer's shape or delivery, what is accepted and changes
# nothing (user, metadata, ...), what is refused unless off (tests/test_api_validation.py).
NOT_CONTROLS = {
    "infer_token": {"details", "typical_p", "watermark", "pad_id", "prompt_embedding_table", "prompt_vocab_size",
                    "draft_logits", "lora_task_id", "lora_weights", "lora_config",
                    "is_need_logits"},  # refused by name when true (docs/serving.md): nothing reaches the engine
    "chat": {"messages", "stream", "stream_options", "user", "metadata", "store", "service_tier",
             "prompt_cache_key", "safety_identifier", "function_call", "modalities", "audio", "prediction",
             "verbosity", "web_search_options", "functions", "spaces_between_special_tokens", "parallel_tool_calls",
             "reasoning_effort", "chat_template_kwargs"},
    "completions": {"prompt", "stream", "stream_options", "user", "spaces_between_special_tokens", "suffix",
                    "error_behavior"},
    "responses": {"input", "instructions", "stream", "stream_options", "store", "previous_response_id", "include",
                  "truncation", "top_logprobs", "metadata", "user", "safety_identifier", "prompt_cache_key",
                  "service_tier", "reasoning", "parallel_tool_calls", "background", "conversation", "prompt",
                  "max_tool_calls", "context_management", "prompt_cache_retention", "prompt_cache_options",
                  "access_programs", "image", "moderation", "background_options"},
    "messages": {"messages", "system", "stream", "metadata", "service_tier", "speed", "inference_geo",
                 "user_profile_id", "workspace_id", "cache_control", "container", "mcp_servers",
                 "context_management", "diagnostics"},
}
NOT_CONTROLS["completions_ids"] = NOT_CONTROLS["completions"]
NOT_CONTROLS.update({inv: NOT_CONTROLS[base] for inv, base in INVOCATIONS.items()})


def value_at(request: GenerationRequest, path: str) -> Any:
    if path.endswith(".__len__"):
        return len(read(request, path.removesuffix(".__len__")))
    return read(request, path)


def only_request(route: str, fields: dict, front: OpenAIFrontend) -> GenerationRequest:
    (request,) = ROUTES[route].engine_requests(body_with(route, fields), front)
    return request


CASES = [pytest.param(route, row, id=f"{route}-{'+'.join(row.fields)}-{j}")
         for j, row in enumerate(ROWS) for route in routes_of(row)]


@pytest.mark.parametrize("route,row", CASES)
def test_a_control_field_reaches_the_engine_request(route, row, fronts):
    request = only_request(route, row.fields, fronts[row.front])
    for path, expected in row.reads.items():
        assert value_at(request, path) == expected, f"{route} {row.fields} -> {path}"
    # Everything else keeps its default: the field moved only what its row says.
    moved = set(row.reads)
    for path, default in DEFAULTS[route].items():
        if path not in moved and not any(path.startswith(f"{m}.") or m.startswith(f"{path}.") for m in moved):
            assert value_at(request, path) == default, f"{route} {row.fields} also moved {path}"


@pytest.mark.parametrize("route", EVERY)
def test_an_absent_field_sends_the_default(route, fronts):
    request = only_request(route, {}, fronts["plain"])
    for path, expected in DEFAULTS[route].items():
        assert value_at(request, path) == expected, f"{route}: absent -> {path}"


def test_the_reasoning_switches_reach_the_template(fronts):
    """chat_template_kwargs and Responses' reasoning.effort "none" switch a Qwen3 template's
    thinking off; Messages thinks only when ``thinking`` is enabled (absent is disabled, as
    Anthropic's): off, the prompt ends in the template's empty think block."""
    empty_think = fronts["reasoning"].tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    switched = {  # route: (thinking on, thinking off)
        "chat": ({}, {"chat_template_kwargs": {"enable_thinking": False}}),
        "responses": ({}, {"reasoning": {"effort": "none"}}),
        "messages": ({"thinking": {"type": "enabled", "budget_tokens": 4}}, {}),
    }
    for route, (on_fields, off_fields) in switched.items():
        on = only_request(route, on_fields, fronts["reasoning"]).prompt_token_ids
        off = only_request(route, off_fields, fronts["reasoning"]).prompt_token_ids
        assert off[-len(empty_think):] == empty_think and on[-len(empty_think):] != empty_think, route


@pytest.mark.parametrize("route", EVERY)
def test_every_field_of_every_route_is_in_the_table(route):
    """A field the schema declares is a control with a row, or named in NOT_CONTROLS."""
    covered = {name for row in ROWS if route in routes_of(row) for name in row.fields}
    schema = ROUTES[route].schema
    declared = {field.alias or name for name, field in schema.model_fields.items()}
    missing = declared - covered - NOT_CONTROLS[route]
    assert not missing, f"{route}: fields with no row in ROWS (nor in NOT_CONTROLS): {sorted(missing)}"
    stale = (NOT_CONTROLS[route] | covered) - declared
    assert not stale, f"{route}: the table names fields the schema does not have: {sorted(stale)}"


def test_a_bad_value_is_refused_naming_its_field(fronts):
    """The table's values are the schema's to check: out of range, each is refused by name."""
    for route, fields, name in (("chat", {"top_p": -0.1}, "top_p"), ("messages", {"temperature": 1.5}, "temperature"),
                                ("responses", {"priority": 0}, "priority"), ("infer_token", {"timeout": 0}, "timeout")):
        with pytest.raises(pydantic.ValidationError) as raised:
            only_request(route, fields, fronts["plain"])
        assert name in {str(part) for error in raised.value.errors() for part in error["loc"]}, route


def test_an_invocation_takes_its_task_from_the_body_and_its_model_from_the_endpoint(fronts):
    """Databricks' invocations: ``messages``, ``prompt`` or ``input`` picks the request; a ``model``
    naming another model than the endpoint's is refused by name, as is a body with no task or two."""
    for body, request_type in (({"messages": USER}, ChatCompletionRequest), ({"prompt": "Hi"}, CompletionRequest),
                               ({"input": ["a", "b"]}, EmbeddingRequest)):
        parsed = databricks.parsed(body, databricks.task_of(body), "the-endpoint")
        assert type(parsed) is request_type and parsed.model == "the-endpoint"
    with pytest.raises(APIError) as refused:
        databricks.parsed({"messages": USER, "model": "another"}, "messages", MODEL)
    assert (refused.value.status, refused.value.param) == (400, "model")
    for body in ({"max_tokens": 3}, {"messages": USER, "prompt": "Hi"}):
        with pytest.raises(APIError) as refused:
            databricks.task_of(body)
        assert refused.value.status == 400 and "'messages' (chat)" in refused.value.message
