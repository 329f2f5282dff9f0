"""Request schemas of the OpenAI-compatible API: OpenAI's current chat-completions,
completions and embeddings references, with MindIE's (seeds/001) and Databricks' (seeds/002)
ranges and extensions. Every field OpenAI defines is declared here: it changes the output, or
it is refused with a 400 that names it (dialects/json_types.py ``only()``), or,
for the few that by definition change nothing here (``user``, ``metadata``, ...), it is
accepted. Unknown fields are refused. docs/api.md has each decision.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr, WithJsonSchema,
                      field_validator, model_validator)

from dialects.json_types import Seed, StrictModel, TokenId, check_stream_options, only
from dialects.serving_fields import IgnoreEos, Timeout, VllmPriority
from engine.request import MAX_CHOICES, PRIORITY_MAX
from sampling.grammar import Grammar
from sampling.params import MAX_TOP_LOGPROBS

MODEL_NAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,254}[A-Za-z0-9])?$"
MAX_MESSAGES_BYTES = 512 * 1024  # total content of a chat request
MAX_N = MAX_CHOICES  # choices per prompt (OpenAI's limit too)
MAX_STOP = 16  # stop strings per request
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
MAX_BATCH_PROMPTS = 64  # prompts in one completions request, inputs in one embeddings request
MAX_TOOLS = 32  # Databricks' limits (seeds/002)
MAX_TOOL_PROPERTIES = 15  # properties of one function's parameters
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # a function's or a response schema's name (OpenAI's rule)
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# A completion's prompt, an embedding's input: one or a batch, of text or of token ids.
TextsOrTokenIds = Annotated[
    NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)],
    Field(description="a string, a list of strings, a list of token ids, or a list of such lists")]


def as_batch(value: str | list) -> list[str] | list[list[int]]:
    """One text or one token-id list becomes a batch of one."""
    return [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)
# OpenAI's service tiers: one tier here, so each is served alike (docs/api.md).
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class StreamOptions(StrictModel):
    include_usage: StrictBool = False
    include_obfuscation: Annotated[StrictBool, only(False, description="no obfuscation padding is added",
                                                    refusal="this server adds no obfuscation; send false")] = False


MAX_GRAMMAR_CHOICES = 256  # strings in structured_outputs.choice


class StructuredOutputs(StrictModel):
    """vLLM's extension for what response_format cannot say: the whole output matches a regular
    expression, or is one of a list of strings. One of the two."""

    regex: NonEmptyStr | None = Field(None, description="the whole output matches it (Rust regex syntax)")
    choice: Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_GRAMMAR_CHOICES)] | None = Field(
        None, description="the output is exactly one of these")

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.regex is None) == (self.choice is None):
            raise ValueError("structured_outputs: give exactly one of regex and choice")
        return self

    def grammar(self) -> Grammar:
        if self.regex is not None:
            return Grammar("regex", self.regex, "structured_outputs.regex")
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(self.choice))
        return Grammar("lark", f"start: {literals}\n", "structured_outputs.choice")


class SamplingFields(StrictModel):
    """Fields that chat and completions share."""

    model: StrictStr = Field(pattern=MODEL_NAME_PATTERN, description="letters, digits, '.', '-', '_'; <= 256")
    max_tokens: StrictInt | None = Field(
        None, ge=0, description="(0, max_iter_times]; absent: max_iter_times. 0 only on completions with echo")
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0, description="[0, 2]; 0 is greedy")
    top_p: StrictFloat = Field(1.0, ge=0.0, le=1.0, description="[0, 1]; 0 is greedy, as temperature 0 (Databricks)")
    top_k: StrictInt | None = Field(None, ge=-1, description="absent, 0 or -1 (vLLM's 'off'): no top-k")
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    seed: Seed | None = Field(None, description="absent: the server draws one")
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    n: StrictInt = Field(1, gt=0, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None
    user: StrictStr | None = Field(None, description="accepted; identifies the caller, changes nothing")
    # Extensions, as on /infer_token.
    priority: VllmPriority
    timeout: Timeout
    ignore_eos: IgnoreEos
    # vLLM's sampling extensions (docs/api.md): each reaches the engine's own control.
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top one's probability")
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, le=2.0, description="transformers' rule over prompt and "
                                                                              "output; 1 is off")
    min_tokens: StrictInt = Field(0, ge=0, description="EOS is held back until this many tokens are generated")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="token ids that end the output (the token is kept in it, as vLLM does)")
    skip_special_tokens: StrictBool = Field(True, description="false: special tokens are written into the text")
    truncate_prompt_tokens: Annotated[StrictInt, WithJsonSchema({"anyOf": [
        {"const": -1}, {"type": "integer", "minimum": 1}]})] | None = Field(
        None, ge=-1, description="keep only the prompt's last k tokens (chat: of the templated prompt); -1: as many "
                                 "as fit")
    include_stop_str_in_output: StrictBool = Field(
        False, description="vLLM's extension: true keeps the matched stop string at the end of the text")
    spaces_between_special_tokens: Annotated[StrictBool, only(True, description=(
        "fast tokenizers always decode without added spaces; the value that matches them"), refusal=(
        "this server decodes with a fast tokenizer, which adds no spaces between special tokens; send true"))] = True
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension: a regex or a choice list the output must match")
    prompt_lookup: StrictBool | None = Field(
        None, description="speculative decoding by prompt lookup, the same output sooner on text that repeats its "
                          "prompt (docs/serving.md); absent: the server's setting")

    @field_validator("priority")
    @classmethod
    def _vllm_default_priority(cls, priority: int) -> int:
        return PRIORITY_MAX if priority == 0 else priority  # vLLM's default 0 is "no priority": served as the default here

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def output_limit(self) -> int | None:
        """The requested cap on generated tokens (chat's max_completion_tokens wins)."""
        return self.max_tokens

    def has_grammar(self) -> bool:
        return self.structured_outputs is not None

    @model_validator(mode="after")
    def _sampling_fields(self):
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be >= 1, or -1 for as many as fit")
        if self.min_tokens:
            limit = self.output_limit()
            if limit is not None and self.min_tokens > limit:
                raise ValueError(f"min_tokens: must be <= the output limit ({limit})")
            if self.stop or self.stop_token_ids:
                raise ValueError("min_tokens: cannot be combined with stop or stop_token_ids here (only EOS is held "
                                 "back until min_tokens)")
            if self.has_grammar():
                raise ValueError("min_tokens: cannot be combined with a grammar (response_format, structured_outputs "
                                 "or tools): once the grammar is complete only EOS may follow")
        check_stream_options(self.stream_options, self.stream)
        return self


class TextPart(StrictModel):
    type: Literal["text"]
    text: NonEmptyStr


# What the schema says of list content: text parts only (other parts are refused with a 400
# that names their type, rather than pydantic's account of a failed union).
TEXT_PARTS_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "additionalProperties": False, "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string", "minLength": 1}}}}


class CalledFunction(StrictModel):
    name: StrictStr = Field(pattern=NAME_PATTERN)
    arguments: StrictStr = Field(description="the arguments as a JSON string, as the assistant wrote them")


class MessageToolCall(StrictModel):
    """A call an earlier assistant turn made (multi-turn tool use)."""

    id: NonEmptyStr
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or OpenAI's list of parts; only text parts are read (this model reads text only).
    # Null only for an assistant turn that made tool calls.
    content: NonEmptyStr | Annotated[list[dict[str, Any]], Field(min_length=1), WithJsonSchema(TEXT_PARTS_SCHEMA)] \
        | None = Field(None, description="required, except on an assistant message with tool_calls")
    name: StrictStr | None = Field(None, description="given to the chat template, which may use it")
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = Field(
        None, description="assistant messages only: the calls that turn made")
    tool_call_id: StrictStr | None = Field(None, description="tool messages only, required there: the call answered")

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if content is None or isinstance(content, str):
            return content
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "text":
                raise ValueError(f"part {j} is of type {part.get('type')!r}; this model reads text parts only "
                                 "(no image, audio or file input)")
            parts.append(TextPart.model_validate(part))
        return parts

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("content: required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only on assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: required on tool messages, and only there")
        return self

    def text(self) -> str:
        """The content as one string: text parts are joined, as OpenAI's clients send it split."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as the chat template reads it; ``developer`` is OpenAI's new name for ``system``.
        A call's arguments go as an object where they parse (as transformers' templates expect)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return message


def check_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """What a chat template may take: one system (or developer) message, first; a bounded size."""
    roles = ["system" if m.role == "developer" else m.role for m in messages]
    if "system" in roles[1:]:
        raise ValueError("a system (or developer) message may appear only once, as the first message")
    if sum(len(m.text().encode()) for m in messages) > MAX_MESSAGES_BYTES:
        raise ValueError(f"the messages' content exceeds {MAX_MESSAGES_BYTES // 1024} KB")
    return messages


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(StrictModel):
    name: StrictStr = Field(pattern=NAME_PATTERN)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(
        None, description=f"a JSON Schema of the arguments object, at most {MAX_TOOL_PROPERTIES} properties; "
                          "absent: no arguments")
    strict: StrictBool | None = Field(None, description="either way the arguments follow the schema exactly")

    @field_validator("parameters")
    @classmethod
    def _an_object_with_few_properties(cls, parameters):
        if parameters is None:
            return None
        if parameters.get("type", "object") != "object":
            raise ValueError(f"the arguments must be a JSON object: type 'object', got {parameters['type']!r}")
        properties = parameters.get("properties")
        if "properties" in parameters and not isinstance(properties, dict):
            raise ValueError("properties must be an object: a schema per argument")
        count = len(properties) if isinstance(properties, dict) else 0
        if count > MAX_TOOL_PROPERTIES:
            raise ValueError(f"{count} properties; at most {MAX_TOOL_PROPERTIES} per function")
        return parameters

    def parameters_schema(self) -> dict:
        """The arguments' schema: always of an object (absent: one with no properties)."""
        return {"type": "object", **(self.parameters or {"properties": {}})}


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(StrictModel):
    name: StrictStr


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolName


class JsonSchemaFormat(StrictModel):
    name: StrictStr = Field(pattern=NAME_PATTERN)
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the output must validate against")
    strict: StrictBool | None = Field(None, description="either way the output follows the schema exactly")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="required with type json_schema")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema: required with type 'json_schema', and only with it")
        return self

    def grammar(self) -> Grammar | None:
        """What the output must match (grammar-constrained decoding), None for text."""
        if self.type == "json_object":
            return Grammar("json_object", field="response_format")
        if self.type == "json_schema":
            return Grammar("json_schema", json.dumps(self.json_schema.schema_, sort_keys=True),
                           "response_format.json_schema.schema")
        return None


# Chat fields OpenAI defines that need a capability this server does not have: refused with a
# 400 naming the field whenever they are set to anything but their "off" value.
UNSUPPORTED_CHAT_FIELDS = {
    "audio": "audio output needs an audio model",
    "prediction": "predicted outputs are not supported",
    "verbosity": "the served model has no verbosity control",
    "web_search_options": "this server does no web search",
    "functions": "deprecated by OpenAI; send tools",
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Not a field of chat's: Anthropic's thinking.budget_tokens, set by that dialect on the request it makes.
    _thinking_budget: int | None = PrivateAttr(None)
    max_completion_tokens: StrictInt | None = Field(
        None, gt=0, description="OpenAI's current name for max_tokens; wins over it when both are set")
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="absent: 'auto' with tools. 'auto' needs a chat template in Hermes' tool-call syntax")
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call; absent: true")
    function_call: Annotated[StrictStr | dict | None, only("none", None, description="deprecated; only 'none'", refusal=(
        "deprecated by OpenAI; send tool_choice (only 'none' is accepted here)"))] = None
    response_format: ResponseFormat | None = None
    modalities: Annotated[list[Literal["text", "audio"]] | None, only(["text"], None, description="text only",
                                                                      refusal="only ['text'] is served by this model")
                          ] = None
    metadata: dict[str, StrictStr] | None = Field(None, description="accepted; nothing is stored")
    store: Annotated[StrictBool | None, only(False, None, description="nothing is stored", refusal=(
        "this server keeps no completions; send false or leave it out"))] = None
    service_tier: ServiceTier | None = Field(None, description="accepted; one tier here")
    prompt_cache_key: StrictStr | None = Field(None, description="accepted; prefix caching is by content")
    safety_identifier: StrictStr | None = Field(None, description="accepted; identifies the caller")
    # Reasoning models (dialects/reasoning.py): each reaches the chat template where it reads it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="given to the chat template; a 400 when the served template does not read it")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's extension: more variables for the chat template (enable_thinking: false turns "
                          "a Qwen3 model's thinking off); a 400 naming each one the template does not read")
    # Refused unless null (UNSUPPORTED_CHAT_FIELDS says why).
    audio: Annotated[Any, only(None, description=UNSUPPORTED_CHAT_FIELDS["audio"])] = None
    prediction: Annotated[Any, only(None, description=UNSUPPORTED_CHAT_FIELDS["prediction"])] = None
    verbosity: Annotated[Any, only(None, description=UNSUPPORTED_CHAT_FIELDS["verbosity"])] = None
    web_search_options: Annotated[Any, only(None, description=UNSUPPORTED_CHAT_FIELDS["web_search_options"])] = None
    functions: Annotated[Any, only(None, description=UNSUPPORTED_CHAT_FIELDS["functions"])] = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def has_grammar(self) -> bool:
        return (self.structured_outputs is not None or self.tool_mode() is not None
                or (self.response_format is not None and self.response_format.type != "text"))

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        return check_messages(messages)

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be > 0 for chat")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [tool.function.name for tool in self.tools or []]
        for j, name in enumerate(names):
            if name in names[:j]:
                raise ValueError(f"tools.{j}.function.name: {name!r} is defined twice")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice: only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice.function.name: no tool is named {self.tool_choice.function.name!r}")
        structured = self.response_format is not None and self.response_format.type != "text"
        if self.tool_mode() is not None and structured:
            raise ValueError("response_format: cannot be combined with tools unless tool_choice is 'none' "
                             "(a call's arguments already follow their schema)")
        if self.structured_outputs is not None and (structured or self.tool_mode() is not None):
            raise ValueError("structured_outputs: cannot be combined with response_format other than text, nor "
                             "with tools unless tool_choice is 'none' (one grammar per output)")
        tool_call_ids = set()
        for i, message in enumerate(self.messages):
            tool_call_ids |= {call.id for call in message.tool_calls or []}
            if message.role == "tool" and message.tool_call_id not in tool_call_ids:
                raise ValueError(f"messages.{i}.tool_call_id: {message.tool_call_id!r} answers no earlier "
                                 "assistant tool call")

    def tool_mode(self) -> str | None:
        """How the output may call tools: None (it may not), "auto", "required", or a function's name."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def function_parameters(self) -> dict[str, dict]:
        """Each tool's name and parameters schema."""
        return {tool.function.name: tool.function.parameters_schema() for tool in self.tools or []}


class CompletionRequest(SamplingFields):
    prompt: TextsOrTokenIds
    echo: StrictBool = False
    suffix: StrictStr = ""
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: StrictInt | None = Field(
        None, gt=0, le=MAX_N, description=">= n: best_of choices are made, the n of highest mean logprob returned")
    use_raw_prompt: StrictBool = False
    error_behavior: Literal["error", "truncate"] = "error"

    def prompts(self) -> list[str] | list[list[int]]:
        """Each prompt: a string, or token ids taken as they are."""
        return as_batch(self.prompt)

    @model_validator(mode="after")
    def _completion_fields(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is allowed only with echo (to score the prompt)")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of: must be >= n ({self.n})")
            if self.stream and self.best_of > 1:
                raise ValueError("best_of: cannot be streamed (the best choices are known only at the end)")
        return self


class EmbeddingRequest(StrictModel):
    input: TextsOrTokenIds
    model: StrictStr | None = Field(None, pattern=MODEL_NAME_PATTERN)
    instruction: StrictStr | None = Field(None, description="prepended to every text input")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes, as OpenAI's clients ask by default")
    dimensions: Annotated[StrictInt | None, only(None, description="the model has no shortened embeddings", refusal=(
        "all-MiniLM-L6-v2 was not trained for shortened embeddings; leave it out"))] = None
    user: StrictStr | None = Field(None, description="accepted; identifies the caller, changes nothing")

    @model_validator(mode="after")
    def _embedding_fields(self):
        if self.instruction is not None and self.token_inputs():
            raise ValueError("instruction: applies to text input only, not to token ids")
        return self

    def token_inputs(self) -> bool:
        return not isinstance(self.input, str) and isinstance(self.input[0], (int, list))

    def inputs(self) -> list[str] | list[list[int]]:
        """Texts (with the instruction prepended), or token-id lists."""
        items = as_batch(self.input)
        if self.instruction and isinstance(items[0], str):
            return [f"{self.instruction}{t}" for t in items]
        return items
