"""Request schemas of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as
Anthropic's reference and SDK define them: each field changes the output, is accepted as changing
nothing here (``metadata``, ``service_tier``, ``cache_control``), or is refused with a 400 that
names it and says why (images, server tools, extended thinking, ...). Unknown fields are refused.
dialects/anthropic.py turns them into the chat request; docs/api.md has each decision.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator, \
    model_validator

from dialects.json_types import Seed, StrictModel, only
from dialects.openai_schema import MAX_STOP, MAX_TOOLS, MODEL_NAME_PATTERN, NAME_PATTERN
from dialects.serving_fields import Priority, Timeout
from dialects.through_chat import located

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
MAX_MESSAGES = 1024
# Fields that need what this server does not have: refused unless null (or disabled).
UNSUPPORTED = {
    "thinking": "adaptive thinking is not offered; send {\"type\": \"enabled\", \"budget_tokens\": N} (a model "
                "that reasons) or {\"type\": \"disabled\"}",
    "container": "no code-execution containers are offered",
    "mcp_servers": "no MCP servers are run here; send their tools as client tools",
    "context_management": "context management is not offered",
    "diagnostics": "no prompt-cache diagnostics are reported",
}


class CacheControl(StrictModel):
    """Accepted and changes nothing: prefix caching here is by content, automatic."""

    type: Literal["ephemeral"]
    ttl: StrictStr | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: NonEmptyStr
    cache_control: CacheControl | None = None
    citations: Annotated[Any, only(None, [], description="citations are not offered")] = None


class ToolUseBlock(StrictModel):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: StrictStr = Field(pattern=NAME_PATTERN)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: NonEmptyStr | Annotated[list[TextBlock], Field(min_length=1)] = Field(
        description="text, or text blocks (this model reads text only)")
    is_error: StrictBool = Field(False, description="true: the model reads the result after 'Error: '")
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(StrictModel):
    """An earlier assistant turn's thinking, as this server returned it (the signature is not checked)."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr
    cache_control: CacheControl | None = None


BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock}


def _block(j: int, raw: Any) -> TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock:
    """One content block, or a ValueError naming where it is wrong ("<j>.<field>: <rule>")."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in BLOCKS:
        raise ValueError(f"{j}.type: {kind!r} blocks are not supported here; this model reads text, tool_use, "
                         "tool_result and thinking blocks (no images, documents or redacted thinking)")
    try:
        return BLOCKS[kind].model_validate(raw)
    except ValidationError as error:
        raise located(str(j), error) from None


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: NonEmptyStr | Annotated[list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock],
                                     Field(min_length=1)]

    # Blocks and tools are read one by one, so that a 400 names the block and says what is wrong
    # with it, rather than pydantic's account of each member of a failed union.
    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, content):
        return [_block(j, raw) for j, raw in enumerate(content)] if isinstance(content, list) else content

    @model_validator(mode="after")
    def _blocks_of_its_role(self):
        for j, block in enumerate(self.blocks()):
            if isinstance(block, (ToolUseBlock, ThinkingBlock)) and self.role != "assistant":
                raise ValueError(f"content.{j}: {block.type} blocks are the assistant's")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ValueError(f"content.{j}: tool_result blocks are the user's")
        return self

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(StrictModel):
    """A client tool: the model calls it with an ``input`` that validates against ``input_schema``."""

    name: StrictStr = Field(pattern=NAME_PATTERN)
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of an object")
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: StrictBool | None = Field(None, description="either way the input follows the schema exactly")


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = Field(None, description="required with type 'tool', and only there")
    disable_parallel_tool_use: StrictBool = Field(False, description="true: at most one call")

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: required with type 'tool', and only with it")
        return self


class Thinking(StrictModel):
    """enabled: the model's thinking comes back as a thinking block, ended after budget_tokens
    tokens; disabled (or absent): a model whose template can switch its thinking off does not think."""

    type: Annotated[Literal["disabled", "enabled", "adaptive"],
                    only("disabled", "enabled", description=UNSUPPORTED["thinking"])]
    budget_tokens: StrictInt | None = Field(None, ge=1, description="with enabled, and only there; below max_tokens")

    @model_validator(mode="after")
    def _budget_with_enabled(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens: required with type 'enabled', and only with it")
        return self


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the text must validate against")


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = Field(None, description="structured output: decoded as chat's json_schema")
    effort: Annotated[Any, only(None, description="the served model has no effort control")] = None


class Metadata(StrictModel):
    user_id: StrictStr | None = Field(None, description="accepted; identifies the caller, changes nothing")


class CountTokensRequest(StrictModel):
    """The conversation: what /v1/messages/count_tokens counts, and what /v1/messages answers."""

    model: StrictStr = Field(pattern=MODEL_NAME_PATTERN, description="the served model's name")
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: StrictStr | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="client tools only (no server tools)")
    tool_choice: ToolChoice | None = Field(None, description="absent: auto with tools")
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # Refused unless null (UNSUPPORTED says why).
    container: Annotated[Any, only(None, description=UNSUPPORTED["container"])] = None
    mcp_servers: Annotated[Any, only(None, description=UNSUPPORTED["mcp_servers"])] = None
    context_management: Annotated[Any, only(None, description=UNSUPPORTED["context_management"])] = None
    diagnostics: Annotated[Any, only(None, description=UNSUPPORTED["diagnostics"])] = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, tools):
        if not isinstance(tools, list):
            return tools
        checked = []
        for j, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type", "custom") != "custom":
                raise ValueError(f"{j}.type: {tool['type']!r} is a server tool; this server runs none: send client "
                                 "tools (name, description, input_schema)")
            try:
                checked.append(Tool.model_validate(tool))
            except ValidationError as error:
                raise located(str(j), error) from None
        return checked

    @model_validator(mode="after")
    def _offered(self):
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        names = [t.name for t in self.tools or []]
        if self.tool_choice is not None and self.tool_choice.type == "tool" and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice.name: no tool is named {self.tool_choice.name!r}")
        if self.tools and self.output_config is not None and self.output_config.format is not None and \
                (self.tool_choice is None or self.tool_choice.type != "none"):
            raise ValueError("output_config.format: cannot be combined with tools unless tool_choice is 'none' "
                             "(a call's input already follows its schema)")
        return self

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(gt=0, description="(0, max_iter_times]")
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    temperature: StrictFloat = Field(1.0, ge=0.0, le=1.0, description="[0, 1]; 0 is greedy")
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, gt=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="accepted; one tier here")
    speed: Literal["standard"] | None = Field(None, description="one speed here ('fast' is refused)")
    inference_geo: StrictStr | None = Field(None, description="accepted; answered where this server runs")
    user_profile_id: StrictStr | None = Field(None, description="accepted; identifies the caller, changes nothing")
    workspace_id: StrictStr | None = Field(None, description="accepted; identifies the caller, changes nothing")
    # Extensions, as on chat.
    seed: Seed | None = None
    priority: Priority
    timeout: Timeout

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        if self.thinking is not None and self.thinking.budget_tokens is not None and \
                self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens: must be below max_tokens (the answer follows the thinking)")
        return self
