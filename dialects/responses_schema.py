"""Request schema of OpenAI's Responses API (POST /v1/responses), as OpenAI's current reference
and SDK define it: every top-level field is declared; each changes the output, is accepted as
changing nothing here (``user``, ``metadata``, ...), or is refused with a 400 that names it and
says why (built-in tools, background mode, ...). Unknown fields are refused. dialects/responses.py
turns it into the chat request; docs/api.md has each decision.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator,
                      model_validator)

from dialects.json_types import Seed, StrictModel, check_stream_options, only
from dialects.openai_schema import MAX_TOOLS, MODEL_NAME_PATTERN, NAME_PATTERN, ServiceTier
from dialects.serving_fields import Priority, Timeout
from dialects.through_chat import located

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
MAX_INPUT_ITEMS = 1024
# Request fields that need what this server does not have: refused unless null (or their "off" value).
UNSUPPORTED = {
    "background": "background mode is not offered: send the request and wait for it, or stream it",
    "conversation": "conversations are not stored here; chain responses with previous_response_id",
    "prompt": "stored prompt templates are not offered",
    "max_tool_calls": "not offered: the answer's calls are returned to you, none is run here",
    "context_management": "context management is not offered",
    "prompt_cache_retention": "prefix caching is by content and keeps no per-request retention",
    "prompt_cache_options": "prefix caching is by content and takes no options",
    "access_programs": "no access programs are offered",
    "image": "this model reads text only",
    "moderation": "no moderation is offered",
    "background_options": "background mode is not offered",
}
# Tool types OpenAI runs itself; this server runs none of them.
BUILT_IN_TOOLS = "web_search, file_search, computer_use, code_interpreter, image_generation, mcp, shell, ..."
NO_SUMMARY = ("a reasoning summary needs another model to write it, and none is served here; the reasoning itself "
              "comes back as the reasoning item's reasoning_text")


class TextPart(StrictModel):
    """A message's text: input_text from the user, output_text (an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: NonEmptyStr
    annotations: list[Any] | None = None  # output_text as this server returned it
    logprobs: list[Any] | None = None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: NonEmptyStr | Annotated[list[TextPart], Field(min_length=1)]
    id: StrictStr | None = None  # an output message sent back as input
    status: StrictStr | None = None
    phase: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call an earlier answer made, sent back with its output."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: StrictStr = Field(pattern=NAME_PATTERN)
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: NonEmptyStr | Annotated[list[TextPart], Field(min_length=1)]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningItem(StrictModel):
    """An earlier answer's reasoning, sent back as this server returned it (clients resend the
    output whole, e.g. with store false): it is the thinking of the assistant turn that follows."""

    type: Literal["reasoning"]
    summary: Annotated[list[Any], Field(max_length=0, description="always empty: no summaries are written here")]
    content: list[ReasoningText] | None = None
    id: StrictStr | None = None
    status: StrictStr | None = None
    encrypted_content: Annotated[Any, only(None, description="no reasoning is encrypted here", refusal=(
        "no reasoning is encrypted here; send the item as it was returned"))] = None

    @field_validator("summary", mode="before")
    @classmethod
    def _no_summary(cls, summary):
        if isinstance(summary, list) and summary:
            raise ValueError("a reasoning summary is never written here; send the item as it was returned "
                             "(summary [])")
        return summary

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
         "reasoning": ReasoningItem}
PART_TYPES = {"input_text", "output_text"}


def input_item(j: int, raw: Any) -> InputItem:
    """One input item (or an output item sent back), or a ValueError naming where it is wrong
    ("<j>.<field>: <rule>")."""
    if not isinstance(raw, dict):
        raise ValueError(f"{j}: an item is an object")
    kind = raw.get("type", "message")
    if not isinstance(kind, str) or kind not in ITEMS:
        raise ValueError(f"{j}.type: {kind!r} items are not supported here; send messages, function_call, "
                         "function_call_output and reasoning items")
    parts = raw.get("content") if kind == "message" else raw.get("output")
    for k, part in enumerate(parts if isinstance(parts, list) else []):
        if isinstance(part, dict) and not (isinstance(part.get("type"), str) and part["type"] in PART_TYPES):
            where = "content" if kind == "message" else "output"
            raise ValueError(f"{j}.{where}.{k}.type: {part.get('type')!r}: this model reads text only "
                             "(input_text and output_text parts)")
    try:
        return ITEMS[kind].model_validate(raw)
    except ValidationError as error:
        raise located(str(j), error) from None


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: StrictStr = Field(pattern=NAME_PATTERN)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = Field(None, description="either way the arguments follow the schema exactly")

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(StrictModel):
    """text.format: plain text, any JSON object, or JSON that validates against ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = Field(None, pattern=NAME_PATTERN, description="required with json_schema")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="required with json_schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("format: json_schema needs name and schema")
        return self

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Annotated[Any, only(None, description="the served model has no verbosity control")] = None


class ReasoningConfig(StrictModel):
    """``reasoning``: ``effort`` reaches the chat template (dialects/responses.py says how, or
    refuses it naming reasoning.effort); a summary is refused: it needs another model to write it."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="the template's reasoning_effort where it reads one; 'none' switches off a template's "
                          "enable_thinking; a 400 otherwise")
    summary: Annotated[Any, only(None, description=NO_SUMMARY)] = None
    generate_summary: Annotated[Any, only(None, description=NO_SUMMARY)] = None
    context: Literal["auto"] | None = Field(None, description="the chat template decides which turns' reasoning "
                                                              "the model sees")
    mode: Literal["standard"] | None = Field(None, description="one execution mode here")


class StreamOptions(StrictModel):
    include_obfuscation: Annotated[StrictBool, only(False, description="no obfuscation padding is added",
                                                    refusal="this server adds no obfuscation; send false")] = False


class ResponsesRequest(StrictModel):
    model: StrictStr | None = Field(None, pattern=MODEL_NAME_PATTERN, description="absent: the served model")
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: StrictStr | None = Field(None, description="the system message; not carried over by "
                                                             "previous_response_id")
    max_output_tokens: StrictInt | None = Field(None, gt=0, description="(0, max_iter_times]; absent: max_iter_times")
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call; absent: true")
    text: TextConfig | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool = Field(True, description="kept by the ingress replica, bounded in count and age")
    previous_response_id: StrictStr | None = None
    include: Annotated[list[StrictStr] | None, only([], None, description="nothing extra can be included",
                                                    refusal="nothing extra can be included here")] = None
    truncation: Literal["disabled"] | None = Field(None, description="'auto' is refused: a prompt that does not "
                                                                     "fit is a 400")
    top_logprobs: Annotated[StrictInt | None, only(0, None, description="logprobs are not offered here", refusal=(
        "logprobs are not offered on /v1/responses; use /v1/chat/completions"))] = None
    metadata: dict[str, StrictStr] | None = Field(None, description="kept with the response, echoed")
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = Field(None, description="accepted; prefix caching is by content")
    service_tier: ServiceTier | None = Field(None, description="accepted; one tier here")
    reasoning: ReasoningConfig | None = None
    # Extensions, as on chat.
    seed: Seed | None = None
    top_k: StrictInt | None = Field(None, gt=0)
    priority: Priority
    timeout: Timeout
    # Refused unless null (UNSUPPORTED says why).
    background: Annotated[StrictBool | None, only(False, None, description=UNSUPPORTED["background"])] = None
    conversation: Annotated[Any, only(None, description=UNSUPPORTED["conversation"])] = None
    prompt: Annotated[Any, only(None, description=UNSUPPORTED["prompt"])] = None
    max_tool_calls: Annotated[Any, only(None, description=UNSUPPORTED["max_tool_calls"])] = None
    context_management: Annotated[Any, only(None, description=UNSUPPORTED["context_management"])] = None
    prompt_cache_retention: Annotated[Any, only(None, description=UNSUPPORTED["prompt_cache_retention"])] = None
    prompt_cache_options: Annotated[Any, only(None, description=UNSUPPORTED["prompt_cache_options"])] = None
    access_programs: Annotated[Any, only(None, description=UNSUPPORTED["access_programs"])] = None
    image: Annotated[Any, only(None, description=UNSUPPORTED["image"])] = None
    moderation: Annotated[Any, only(None, description=UNSUPPORTED["moderation"])] = None
    background_options: Annotated[Any, only(None, description=UNSUPPORTED["background_options"])] = None

    # Items and tools are read one by one, so that a 400 names the item and says what is wrong
    # with it, rather than pydantic's account of each member of a failed union.
    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value):
        return [input_item(j, raw) for j, raw in enumerate(value)] if isinstance(value, list) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools):
        if not isinstance(tools, list):
            return tools
        checked = []
        for j, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"{j}.type: {kind!r} is a built-in tool ({BUILT_IN_TOOLS}); this server runs "
                                 "none of them: send function tools")
            try:
                checked.append(FunctionTool.model_validate(tool))
            except ValidationError as error:
                raise located(str(j), error) from None
        return checked

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice):
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(f"type: {choice.get('type')!r}: only a function (or none, auto, required) can be "
                             "chosen; no built-in tools are offered")
        return choice

    @model_validator(mode="after")
    def _offered(self):
        check_stream_options(self.stream_options, self.stream)
        return self

    def items(self) -> list[InputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
