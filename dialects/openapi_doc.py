"""/openapi.json: FastAPI's schema, completed with what pydantic cannot say.

- the statuses each route returns are declared on the routes; the 422 FastAPI adds to every
  route with a body is removed (validation errors are 400s in OpenAI's shape);
- rules across fields that JSON Schema can say (``add_rules_across_fields``);
- the served model's limits, once the engines are known: token ids below its vocabulary,
  ``max_tokens`` up to ``max_iter_times``, ``embedding_bias`` of the vocabulary's length.

A schema-driven client (schemathesis, code generators) then builds no request that the
validators refuse, except for the rules no JSON Schema can say (docs/api.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dialects.openai_schema import MAX_TOOL_PROPERTIES
from engine.model_info import ModelInfo
from sampling.params import MAX_SEED


@dataclass
class Served:
    """What the schema states of this deployment: the model names and their limits."""

    name: str
    info: ModelInfo
    adapter_names: list[str] = field(default_factory=list)  # LoRA adapters served by name
    embedding_name: str | None = None
    embedding_vocab: int | None = None


def openapi_schema(app: FastAPI, served: Served | None) -> dict:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    schemas = schema["components"]["schemas"]
    _exact_integer_bounds(schemas)
    add_rules_across_fields(schemas)
    if served is not None:
        add_model_limits(schema, served)
    return schema


def _schemas_of(kind: str, node):
    """Every schema of type ``kind`` ("integer", "array") inside ``node``."""
    if isinstance(node, dict):
        if node.get("type") == kind:
            yield node
        for child in node.values():
            yield from _schemas_of(kind, child)
    elif isinstance(node, list):
        for child in node:
            yield from _schemas_of(kind, child)


def _exact_integer_bounds(schemas: dict) -> None:
    """FastAPI writes every bound as a float: 128.0, and 2^64 - 1 as 2^64, which a seed may not
    be. Integer bounds are written as integers, the seed's as 2^64 - 1."""
    for node in _schemas_of("integer", schemas):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(node.get(key), float):
                node[key] = int(node[key])
    for request in ("InferParameters", "ChatCompletionRequest", "CompletionRequest", "ResponsesRequest",
                    "MessagesRequest"):
        _cap(schemas[request]["properties"]["seed"], "maximum", MAX_SEED)


def _when(field: str, condition: dict, then: dict) -> dict:
    return {"if": {"properties": {field: condition}, "required": [field]}, "then": then}


def _must(field: str, value) -> dict:
    return {"properties": {field: {"const": value}}, "required": [field]}


def add_rules_across_fields(schemas: dict) -> None:
    """Only the first message may be system/developer; top_logprobs needs logprobs;
    stream_options needs stream; max_tokens 0 needs echo; a stream takes no best_of above 1;
    instruction is for text input only; the tool rules (``_tool_rules``, ``_message_rules``);
    a function's parameters are an object schema of at most 15 properties."""
    chat, completion, embedding = (schemas[n] for n in ("ChatCompletionRequest", "CompletionRequest",
                                                         "EmbeddingRequest"))
    message = {"$ref": "#/components/schemas/ChatMessage"}
    chat["properties"]["messages"].update(
        prefixItems=[message],
        items={"allOf": [message, {"properties": {"role": {"not": {"enum": ["system", "developer"]}}}}]})
    streaming = _when("stream_options", {"type": "object"}, _must("stream", True))
    chat["allOf"] = [streaming, _when("top_logprobs", {"type": "integer"}, _must("logprobs", True)), *_tool_rules()]
    schemas["ChatMessage"]["allOf"] = _message_rules()
    schemas["StructuredOutputs"]["anyOf"] = [  # exactly one of regex and choice
        {"required": [one], "properties": {one: {"type": kind}, other: {"type": "null"}}}
        for one, kind, other in (("regex", "string", "choice"), ("choice", "array", "regex"))]
    parameters = schemas["FunctionDefinition"]["properties"]["parameters"]["anyOf"][0]
    parameters["properties"] = {"type": {"const": "object"},
                                "properties": {"type": "object", "maxProperties": MAX_TOOL_PROPERTIES}}
    completion["allOf"] = [streaming, _when("max_tokens", {"const": 0}, _must("echo", True)),
                           _when("stream", {"const": True}, {"properties": {"best_of": {"enum": [None, 1]}}}),
                           _min_tokens_rule()]
    # Chat's min_tokens exclusions are left out of the schema: schemathesis cannot generate from them
    # beside the tool rules. Its refusals name min_tokens (tests/schemathesis_hooks.py).
    token_input = {"type": "array", "items": {"type": ["integer", "array"]}}
    embedding["allOf"] = [_when("input", token_input, {"properties": {"instruction": {"type": "null"}}})]
    tokenize = schemas["TokenizeRequest"]
    tokenize["properties"]["messages"]["anyOf"][0].update(chat["properties"]["messages"])
    tokenize["allOf"] = _tokenize_rules()
    _through_chat_rules(schemas)


def _through_chat_rules(schemas: dict) -> None:
    """Chat's rules as Responses and Anthropic's requests say them (dialects/responses_schema.py,
    anthropic_schema.py): stream_options needs stream; a tool_choice other than none needs tools;
    structured output only where no tool may be called; json_schema needs its name and schema; a
    named Anthropic tool_choice has a name, the others none."""
    responses, messages, counted = (schemas[n] for n in ("ResponsesRequest", "MessagesRequest",
                                                         "CountTokensRequest"))
    no_tools = {"anyOf": [{"properties": {"tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}},
                          _must("tool_choice", "none")]}
    tools_given = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    structured = {"type": "object", "required": ["format"], "properties": {"format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
    responses["allOf"] = [_when("stream_options", {"type": "object"}, _must("stream", True)),
                          _when("tool_choice", {"not": {"enum": ["none", None]}}, tools_given),
                          _when("text", structured, no_tools)]
    schemas["TextFormat"]["allOf"] = [_when("type", {"const": "json_schema"}, {
        "required": ["name", "schema"], "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}})]
    anthropic_no_tools = {"anyOf": [{"properties": {"tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}},
                                    {"required": ["tool_choice"], "properties": {"tool_choice": {
                                        "type": "object", "properties": {"type": {"const": "none"}}}}}]}
    for request in (messages, counted):
        request["allOf"] = [
            _when("tool_choice", {"type": "object", "properties": {"type": {"not": {"const": "none"}}}}, tools_given),
            _when("output_config", {"type": "object", "required": ["format"], "properties": {
                "format": {"type": "object"}}}, anthropic_no_tools)]
    schemas["ToolChoice"]["allOf"] = [
        _when("type", {"const": "tool"}, {"required": ["name"], "properties": {"name": {"type": "string"}}}),
        _when("type", {"not": {"const": "tool"}}, {"properties": {"name": {"type": "null"}}})]


def _tokenize_rules() -> list[dict]:
    """/tokenize: exactly one of prompt and messages; tools and continue_final_message only with
    messages; continue_final_message needs add_generation_prompt false."""
    with_prompt = {"required": ["prompt"], "properties": {
        "prompt": {"type": "string"}, "messages": {"type": "null"}, "tools": {"type": "null"},
        "continue_final_message": {"const": False}}}
    with_messages = {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}
    return [{"anyOf": [with_prompt, with_messages]},
            _when("continue_final_message", {"const": True}, _must("add_generation_prompt", False))]


def _min_tokens_rule() -> dict:
    """min_tokens above 0 only without stop strings, stop_token_ids or structured_outputs."""
    return _when("min_tokens", {"type": "integer", "minimum": 1}, {"properties": {
        "stop": {"type": "null"}, "stop_token_ids": {"anyOf": [{"type": "null"}, {"maxItems": 0}]},
        "structured_outputs": {"type": "null"}}})


def _tool_rules() -> list[dict]:
    """tool_choice other than none needs tools; response_format other than text, and
    structured_outputs, only where no tool may be called; structured_outputs only with a text
    response_format."""
    no_tools = {"anyOf": [{"properties": {"tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}},
                          _must("tool_choice", "none")]}
    structured = {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
    text_only = {"properties": {"response_format": {"anyOf": [{"type": "null"}, {"properties": {
        "type": {"const": "text"}}}]}}}
    return [_when("tool_choice", {"not": {"enum": ["none", None]}},
                  {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}),
            _when("response_format", structured, no_tools),
            _when("structured_outputs", {"type": "object"}, {"allOf": [no_tools, text_only]})]


def _message_rules() -> list[dict]:
    """content may be left out only by an assistant message with tool_calls; tool_calls only on
    assistant messages; tool_call_id on tool messages, and only there."""
    return [{"anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                       {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}}]},
            _when("tool_calls", {"type": "array"}, _must("role", "assistant")),
            _when("role", {"const": "tool"}, {"required": ["tool_call_id"],
                                               "properties": {"tool_call_id": {"type": "string"}}}),
            _when("tool_call_id", {"type": "string"}, _must("role", "tool"))]


def _cap(node, key: str, value) -> None:
    """Set ``key`` (a maximum, a length) on every integer (or array) schema inside ``node``;
    a maximum only lowers the one there."""
    for schema in _schemas_of("array" if key.endswith("Items") else "integer", node):
        schema[key] = min(schema.get(key, value), value) if key == "maximum" else value


def integer_pattern(maximum: int) -> str:
    """A regex of the decimal integers 0..maximum, no leading zeros (logit_bias's keys)."""
    digits = str(maximum)
    shorter = [r"[0-9]"] + [rf"[1-9][0-9]{{{n}}}" for n in range(1, len(digits) - 1)]
    lowest = [int(i == 0 and len(digits) > 1) for i in range(len(digits))]  # no leading zero
    same = [digits[:i] + f"[{lowest[i]}-{int(d) - 1}]" + "[0-9]" * (len(digits) - i - 1)
            for i, d in enumerate(digits) if int(d) > lowest[i]]
    alternatives = (shorter if len(digits) > 1 else []) + same + [digits]
    return "^(" + "|".join(alternatives) + ")$"


def add_model_limits(schema: dict, served: Served) -> None:
    """The served names as the only values of ``model``, and the limits of the models' vocabularies."""
    schemas, info = schema["components"]["schemas"], served.info
    generators = [served.name, *served.adapter_names]
    names = generators + ([served.embedding_name] if served.embedding_name else [])
    for parameter in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        parameter["schema"]["enum"] = names
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[request]["properties"]["model"]["enum"] = generators
    # Responses' and Anthropic's requests (dialects/responses_schema.py, anthropic_schema.py) go through chat's.
    schemas["ResponsesRequest"]["properties"]["model"]["anyOf"][0]["enum"] = generators
    for request in ("MessagesRequest", "CountTokensRequest"):
        schemas[request]["properties"]["model"]["enum"] = generators
    for request, name in (("ResponsesRequest", "max_output_tokens"), ("MessagesRequest", "max_tokens")):
        _cap(schemas[request]["properties"][name], "maximum", info.max_iter_times)
    for request in ("TokenizeRequest", "DetokenizeRequest"):
        schemas[request]["properties"]["model"]["anyOf"][0]["enum"] = generators
    if served.embedding_name is not None:
        schemas["EmbeddingRequest"]["properties"]["model"]["anyOf"][0]["enum"] = [served.embedding_name]
        _cap(schemas["EmbeddingRequest"]["properties"]["input"], "maximum", served.embedding_vocab - 1)
    last_id = info.vocab_size - 1
    infer, parameters = schemas["InferTokenRequest"]["properties"], schemas["InferParameters"]["properties"]
    for node in (infer["input_id"], parameters["stop_words"], parameters["bad_words"], parameters["end_id"],
                 parameters["draft_input_ids"], schemas["CompletionRequest"]["properties"]["prompt"],
                 schemas["CompletionRequest"]["properties"]["stop_token_ids"],
                 schemas["ChatCompletionRequest"]["properties"]["stop_token_ids"],
                 schemas["DetokenizeRequest"]["properties"]["tokens"]):
        _cap(node, "maximum", last_id)
    gap = info.max_model_len - info.max_iter_times  # the longest prompt (dialects/openai_api.py)
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        _cap(schemas[request]["properties"]["truncate_prompt_tokens"], "maximum",
             gap if gap > 0 else info.max_model_len - 1)
    for key in ("minItems", "maxItems"):
        _cap(parameters["embedding_bias"], key, info.vocab_size)
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[request]["properties"]["logit_bias"]["anyOf"][0]["propertyNames"] = {
            "pattern": integer_pattern(last_id)}
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        for name in ("max_tokens", "max_completion_tokens"):
            if name in schemas[request]["properties"]:
                _cap(schemas[request]["properties"][name], "maximum", info.max_iter_times)
