"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): its request
(dialects/anthropic_schema.py) becomes the chat request (dialects/openai_schema.py
ChatCompletionRequest), so the chat template, the tools grammar, stop strings, limits and
priorities are chat's own; the chat answer becomes Anthropic's message, whole or as its
server-sent events; errors take Anthropic's shape. docs/api.md has each decision.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal
import uuid

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from dialects import through_chat
from dialects.anthropic_schema import (CountTokensRequest, MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock,
                                       ToolUseBlock)
from dialects.errors import APIError
from dialects.json_types import sse_event
from dialects.openai_api import Choice, OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.reasoning import THINK_END, THINK_START, template_mentions
from engine.outputs import LENGTH, STOP, TIMEOUT, RequestOutput

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Anthropic's error types by status (its errors reference); 503 is its "overloaded".
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
ROUTE = "/v1/messages"  # the paths whose errors take Anthropic's shape (count_tokens too, under any prefix)


# ---- into the chat request ----------------------------------------------------------------------


def chat_messages(body: CountTokensRequest, reasons: bool) -> list[dict]:
    """The conversation as chat messages: a user turn's tool_result blocks become tool messages
    (before its text, as Anthropic orders them), an assistant turn's tool_use blocks its calls and
    its thinking blocks ``<think>…</think>`` before its text, as the model wrote them (the
    template keeps or drops them: Qwen3's keeps the thinking of the turns after the last user
    message, as Anthropic keeps it in a tool-use loop). ``reasons``: the served model thinks."""
    messages = [{"role": "system", "content": body.system_text()}] if body.system_text() else []
    for i, message in enumerate(body.messages):
        blocks = message.blocks()
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        thought = [(j, b) for j, b in enumerate(blocks) if isinstance(b, ThinkingBlock)]
        if thought and not reasons:
            where = f"messages.{i}.content.{thought[0][0]}"
            raise APIError(400, f"{where}: a thinking block, and the served model does not think", where,
                           "invalid_value")
        if thought:
            text = THINK_START + "".join(b.thinking for _, b in thought) + THINK_END + text
        if message.role == "user":
            messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                         for b in blocks if isinstance(b, ToolResultBlock)]
            if text:
                messages.append({"role": "user", "content": text})
            continue
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    return messages


def chat_request(body: CountTokensRequest, front: OpenAIFrontend) -> ChatCompletionRequest:
    """The one internal request chat uses."""
    generating = isinstance(body, MessagesRequest)
    if generating and body.max_tokens > front.max_iter_times:
        raise APIError(400, f"max_tokens: must be in (0, {front.max_iter_times}] (max_iter_times)", "max_tokens",
                       "invalid_value")
    thinking = body.thinking.type if body.thinking is not None else "disabled"
    if thinking == "enabled" and front.reasoning is None:
        raise APIError(400, "thinking: the served model does not reason (its chat template has no <think>); send "
                            "{\"type\": \"disabled\"} or leave it out", "thinking", "unsupported")
    choice = body.tool_choice
    fields = {"model": body.model, "messages": chat_messages(body, front.reasoning is not None),
              "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema}} for t in body.tools or []],
              "tool_choice": None if choice is None else TOOL_CHOICES.get(choice.type) or {
                  "type": "function", "function": {"name": choice.name}},
              "parallel_tool_calls": None if choice is None else not choice.disable_parallel_tool_use}
    output_format = body.output_config.format if body.output_config is not None else None
    if generating and output_format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": output_format.schema_}}
    for tool in fields["tools"]:
        if tool["function"]["description"] is None:
            del tool["function"]["description"]
    if thinking == "disabled" and template_mentions(front.tokenizer.chat_template, "enable_thinking"):
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if generating:
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, seed=body.seed, priority=body.priority,
                      timeout=body.timeout)
    request = through_chat.chat_request(fields, {"response_format": "output_config.format", "stop": "stop_sequences"})
    if thinking == "enabled" and generating:
        request._thinking_budget = body.thinking.budget_tokens
    return request


def count_tokens(body: CountTokensRequest, front: OpenAIFrontend) -> dict:
    """POST /v1/messages/count_tokens: the templated prompt's length; the chat request is made (and
    checked) but not started."""
    (choice,) = front.chat_choices(chat_request(body, front), "count-tokens", 0.0)
    return {"input_tokens": choice.prompt_tokens}


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (Anthropic's is encrypted; nothing here
    checks it when the block comes back)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def thinking_block(thinking: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": signature(thinking)}


# ---- the answer ---------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call (chat's call_<hex> as toolu_<hex>)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(choice: Choice, called: bool, stop_strings: list[str], tokenizer) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a call that was not cut off is "tool_use"; a stop string is
    named by where the text was cut (the engine cuts it off the text)."""
    reason = choice.final.finish_reason
    if reason in (LENGTH, TIMEOUT):
        return "max_tokens", None
    if called:
        return "tool_use", None
    if reason == STOP and stop_strings:
        # The last output holds every token: decoded, the text goes on past the cut with the stop string.
        raw = tokenizer.decode(choice.final.output_token_ids or [], skip_special_tokens=True)
        rest = raw[len(choice.text):] if raw.startswith(choice.text) else raw
        where = {s: rest.find(s) for s in stop_strings if s in rest}
        return "stop_sequence", min(where, key=where.get) if where else stop_strings[0]
    return "end_turn", None


def usage(choices: list[Choice], output_tokens: int | None = None) -> dict:
    """Input and output tokens; no cache_control breakpoints are kept here, so the cache counts are 0."""
    counts = OpenAIFrontend.usage(choices)
    return {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"]
            if output_tokens is None else output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


class MessagesExchange:
    """One POST /v1/messages: the chat request it becomes (``chat``), then its answer, whole
    (``response``) or as Anthropic's events (``writer``)."""

    def __init__(self, body: MessagesRequest, front: OpenAIFrontend) -> None:
        self.body, self.front = body, front
        self.id = f"msg_{uuid.uuid4().hex}"
        self.chat = chat_request(body, front)

    def response(self, choices: list[Choice]) -> dict:
        choice = choices[0]
        message, called = OpenAIFrontend.chat_message(choice)
        # The thinking (when the model wrote any) is a block before the answer's, as Anthropic orders them.
        content = [thinking_block(message["reasoning_content"])] if message.get("reasoning_content") else []
        content += [{"type": "text", "text": message["content"]}] if message["content"] else []
        for call in message.get("tool_calls", []):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:  # cut off by max_tokens: the call is not returned (stop_reason says why)
                continue
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": arguments})
        reason, sequence = stop_reason(choice, called, self.body.stop_sequences or [], self.front.tokenizer)
        return {**self.message_start(choices), "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(choices)}

    def message_start(self, choices: list[Choice]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.front.model_name(choices),
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(choices, 0)}

    def writer(self, choices: list[Choice]) -> MessagesStreamWriter:
        return MessagesStreamWriter(self, choices)


class MessagesStreamWriter(through_chat.DeltaWriter):
    """Anthropic's event sequence: message_start, ping; per content block content_block_start,
    content_block_delta (thinking_delta then one signature_delta for a thinking block, text_delta,
    or input_json_delta for a tool_use block)..., content_block_stop;
    then message_delta (stop_reason, output tokens) and message_stop; an error after the start is an
    ``error`` event. Each event carries its SSE ``event:`` name."""

    def __init__(self, exchange: MessagesExchange, choices: list[Choice]) -> None:
        super().__init__(choices, split_reasoning=True)
        self.exchange = exchange
        self._index = -1  # the open block's index
        self._open_type: str | None = None
        self._thinking = ""  # the open thinking block's text, for its signature

    def _start_events(self) -> str:
        return event("message_start", message=self.exchange.message_start(self.choices)) + event("ping")

    def _finish(self, output: RequestOutput) -> str:
        reason, sequence = stop_reason(self.choices[0], self.called, self.exchange.body.stop_sequences or [],
                                       self.exchange.front.tokenizer)
        return self._stop_block() + event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                          usage={"output_tokens": output.num_output_tokens}) + event("message_stop")

    @staticmethod
    def fail(error: APIError) -> str:
        return event("error", error={"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message})

    def _delta(self, delta: dict) -> str:
        if "reasoning" in delta:
            events = "" if self._open_type == "thinking" else self._start_block(
                {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking += delta["reasoning"]
            return events + event("content_block_delta", index=self._index,
                                  delta={"type": "thinking_delta", "thinking": delta["reasoning"]})
        if "content" in delta:
            events = "" if self._open_type == "text" else self._start_block({"type": "text", "text": ""})
            return events + event("content_block_delta", index=self._index,
                                  delta={"type": "text_delta", "text": delta["content"]})
        (call,) = delta["tool_calls"]
        if "id" in call:  # a new call: its first delta names it
            return self._start_block({"type": "tool_use", "id": tool_use_id(call["id"]),
                                      "name": call["function"]["name"], "input": {}})
        return event("content_block_delta", index=self._index,
                     delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]})

    def _start_block(self, block: dict) -> str:
        events = self._stop_block()
        self._index += 1
        self._open_type = block["type"]
        return events + event("content_block_start", index=self._index, content_block=block)

    def _stop_block(self) -> str:
        if self._open_type is None:
            return ""
        events = ""
        if self._open_type == "thinking":  # its signature comes last, before the block stops
            events = event("content_block_delta", index=self._index,
                           delta={"type": "signature_delta", "signature": signature(self._thinking)})
        self._open_type = None
        return events + event("content_block_stop", index=self._index)


def event(kind: str, **fields) -> str:
    return f"event: {kind}\n{sse_event({'type': kind, **fields})}"


# ---- errors in Anthropic's shape ------------------------------------------------------------------------


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of Anthropic's routes (documented per route in /openapi.json)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def documented(*statuses: int) -> dict:
    """``responses=`` of an Anthropic route: the error statuses it can return, with their body."""
    return {status: {"model": AnthropicError, "description": ERROR_TYPES.get(status, "api_error")}
            for status in statuses}


def is_route(path: str) -> bool:
    return ROUTE in path


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def from_openai_error(response: JSONResponse) -> JSONResponse:
    """An error response in OpenAI's shape (the server's handlers make them) in Anthropic's, with
    its status and headers (Retry-After, Allow)."""
    detail = json.loads(response.body)["error"]
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(error_body(response.status_code, detail["message"]), status_code=response.status_code,
                        headers=headers)
