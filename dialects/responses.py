"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}): its request
(dialects/responses_schema.py) becomes the chat request (dialects/openai_schema.py
ChatCompletionRequest), so the chat template, the tools grammar, json_schema output, stop strings,
limits and priorities are chat's own; the chat answer becomes Responses' output items, whole or as
OpenAI's stream events. Stored responses live here too (``ResponseStore``). docs/api.md has each
decision.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
import time

from transformers import PreTrainedTokenizerBase

from dialects import through_chat
from dialects.errors import APIError
from dialects.openai_api import Choice, OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.reasoning import THINK_END, THINK_START, template_mentions
from dialects.responses_schema import (FunctionCallItem, InputItem, MessageItem, NamedFunction, ReasoningItem,
                                       ResponsesRequest, input_item)
from dialects.responses_stream import (ResponsesStreamWriter, function_call_item, message_item, new_id,
                                       reasoning_item, status_of)


# ---- into the chat request ----------------------------------------------------------------------


def chat_messages(items: list[InputItem], reasons: bool) -> list[dict]:
    """Input items as chat messages: function calls join the assistant turn before them (or make
    one), their outputs become tool messages. A reasoning item opens an assistant turn whose
    thinking it is (the assistant message and calls after it join that turn), given to the
    template as ``<think>…</think>`` before the turn's text, as the model wrote it; the template
    keeps or drops it (Qwen3's keeps the thinking after the last user message, as in a tool
    loop). ``reasons``: the served model thinks (elsewhere a reasoning item is a 400)."""
    messages: list[dict] = []
    for j, item in enumerate(items):
        last = messages[-1] if messages else None
        thought_only = last is not None and "thought" in last and not last["content"] and "tool_calls" not in last
        if isinstance(item, ReasoningItem):
            if not reasons:
                raise APIError(400, f"input.{j}: a reasoning item, and the served model does not reason (its chat "
                                    "template has no <think>)", f"input.{j}", "invalid_value")
            if not thought_only:
                last = {"role": "assistant", "content": None, "thought": ""}
                messages.append(last)
            last["thought"] += item.text()
        elif isinstance(item, MessageItem):
            if item.role == "assistant" and thought_only:
                last["content"] = item.text()
            else:
                messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    for message in messages:
        if "thought" in message:
            message["content"] = THINK_START + message.pop("thought") + THINK_END + (message["content"] or "")
        if message["role"] == "assistant" and message.get("tool_calls") and not message["content"]:
            message["content"] = None  # an assistant turn of calls only has no content (chat's rule)
    return messages


def reasoning_fields(body: ResponsesRequest, front: OpenAIFrontend) -> dict:
    """The chat fields of ``reasoning.effort``: the template's reasoning_effort where it reads one
    (as chat's reasoning_effort); "none" switches off the thinking of a template that reads
    enable_thinking (Qwen3's), as chat_template_kwargs would; a 400 naming it otherwise."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    template = front.tokenizer.chat_template
    if effort is None:
        return {}
    if template_mentions(template, "reasoning_effort"):
        return {"reasoning_effort": effort}
    switch = front.reasoning is not None and template_mentions(template, "enable_thinking")
    if effort == "none" and switch:
        return {"chat_template_kwargs": {"enable_thinking": False}}
    why = ("the served model does not reason (its chat template has no <think>)" if front.reasoning is None else
           "the served model's chat template has no reasoning effort control" +
           ("; it switches the thinking on or off: send 'none' to switch it off" if switch else ""))
    raise APIError(400, f"reasoning.effort: {why}", "reasoning.effort", "unsupported")


def chat_request(body: ResponsesRequest, history: list[dict], front: OpenAIFrontend) -> ChatCompletionRequest:
    """The one internal request chat uses: ``history`` (the stored conversation before
    ``previous_response_id``, instructions excluded) then the input, after ``instructions`` and
    the input's own leading system messages, joined as the one system message."""
    if body.max_output_tokens is not None and body.max_output_tokens > front.max_iter_times:
        raise APIError(400, f"max_output_tokens: must be in (0, {front.max_iter_times}] (max_iter_times)",
                       "max_output_tokens", "invalid_value")
    messages = history + chat_messages(body.items(), front.reasoning is not None)
    system = [body.instructions] if body.instructions else []
    while messages and messages[0]["role"] in ("system", "developer"):
        system.append(messages.pop(0)["content"])
    for j, message in enumerate(messages):
        if message["role"] in ("system", "developer"):
            raise APIError(400, "input: a system or developer message may only lead the input (after "
                                f"previous_response_id's conversation, it is message {j})", "input", "invalid_value")
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    fields = {"model": body.model or front.served_model_name, "messages": messages,
              "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k, "priority": body.priority,
              "timeout": body.timeout, "parallel_tool_calls": body.parallel_tool_calls,
              "tools": [t.as_chat_tool() for t in body.tools] if body.tools else None,
              "tool_choice": {"type": "function", "function": {"name": body.tool_choice.name}}
              if isinstance(body.tool_choice, NamedFunction) else body.tool_choice,
              "response_format": body.text.format.as_response_format()
              if body.text is not None and body.text.format is not None else None,
              **reasoning_fields(body, front)}
    return through_chat.chat_request(fields, {"messages": "input", "response_format": "text.format",
                                              "max_completion_tokens": "max_output_tokens"})


# ---- the answer as output items ---------------------------------------------------------------------


def output_items(choice: Choice) -> list[dict]:
    """The whole answer: its thinking as a reasoning item (when the model thought), its text as a
    message (when there is any), then one item per call. Each is completed but the last, which
    has the answer's status (the stream closes each item as the next opens)."""
    message, _ = OpenAIFrontend.chat_message(choice)
    items = [reasoning_item(new_id("rs"), message["reasoning_content"], "completed")] \
        if message.get("reasoning_content") else []
    items += [message_item(new_id("msg"), message["content"], "completed")] if message["content"] else []
    items += [function_call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                 "completed") for c in message.get("tool_calls", [])]
    if items:
        items[-1]["status"] = status_of(choice)
    return items


def reasoning_tokens(choice: Choice, tokenizer: PreTrainedTokenizerBase) -> int:
    """The generated tokens that belong to the thinking: every one up to and including the token
    that completes ``</think>`` (the tag is the thinking's end; the answer starts after it); all of
    them while the thinking is unclosed (cut by max_output_tokens); 0 for an output that does
    not think."""
    reasoning = choice.reasoning.split(choice.text)[0] if choice.reasoning is not None else None
    if reasoning is None:
        return 0
    ids = choice.final.output_token_ids or []
    if THINK_END not in choice.text or not ids:
        return choice.completion_tokens
    # The shortest prefix whose text holds the tag (a prefix's text only grows: bisection).
    return 1 + bisect_left(range(1, len(ids) + 1), True,
                           key=lambda k: THINK_END in tokenizer.decode(ids[:k], skip_special_tokens=False))


def usage(choices: list[Choice], tokenizer: PreTrainedTokenizerBase) -> dict:
    counts = OpenAIFrontend.usage(choices)
    return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(choices[0], tokenizer)},
            "total_tokens": counts["total_tokens"]}


def response_object(body: ResponsesRequest, response_id: str, created: float, model: str, output: list[dict],
                    status: str, usage_: dict | None) -> dict:
    """The Response, as OpenAI returns it: the request's settings echoed, the output, the usage."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "error": None, "background": False,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "input": None, "output": output,
        "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
                        else body.tool_choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text is not None and body.text.format is not None else {"type": "text"}},
        "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user, "usage": usage_,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning is not None else None, "summary": None},
    }


# ---- what the ingress keeps ------------------------------------------------------------------------


def conversation_after(messages: list[dict], output: list[dict]) -> list[dict]:
    """The chat messages a later previous_response_id continues from: this request's, without its
    system message (instructions are not carried over), then the answer's, read as the same
    items sent back as input would be (so continuing and resending give the same prompt)."""
    kept = [m for m in messages if m["role"] != "system"]
    return kept + chat_messages([input_item(j, item) for j, item in enumerate(output)], reasons=True)


@dataclass
class StoredResponse:
    response: dict  # the Response as returned, for GET /v1/responses/{id}
    conversation: list[dict]  # chat messages, for previous_response_id
    stored_at: float


class ResponseStore:
    """Responses kept with ``store`` (the default): in the memory of the ingress replica that made
    them, at most ``max_count`` (the oldest go first) and for at most ``max_age_s``. A restart
    loses them all; with several ingress replicas, each knows only its own (docs/api.md)."""

    def __init__(self, max_count: int = 1024, max_age_s: float = 3600.0) -> None:
        self.max_count, self.max_age_s = max_count, max_age_s
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._kept[response["id"]] = StoredResponse(response, conversation, time.monotonic())
        self._evict()

    def get(self, response_id: str, param: str) -> StoredResponse:
        """The stored response, or a 404 naming ``param``."""
        self._evict()
        stored = self._kept.get(response_id)
        if stored is None:
            raise APIError(404, f"{param}: no response {response_id!r} is kept here (responses are kept by the "
                                f"ingress replica that made them, at most {self.max_count} for "
                                f"{self.max_age_s:.0f} s, and not across restarts)", param, "not_found")
        return stored

    def _evict(self) -> None:
        too_old = time.monotonic() - self.max_age_s
        while self._kept and (len(self._kept) > self.max_count or next(iter(self._kept.values())).stored_at < too_old):
            self._kept.popitem(last=False)


# ---- one request, start to end ---------------------------------------------------------------------


class ResponsesExchange:
    """One POST /v1/responses: the chat request it becomes (``chat``), then its answer, whole
    (``response``) or as stream events (``writer``); either way stored when ``store`` is set."""

    def __init__(self, body: ResponsesRequest, front: OpenAIFrontend, store: ResponseStore) -> None:
        self.body, self.front, self.store = body, front, store
        self.id = new_id("resp")
        self.created = time.time()
        history = store.get(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id else []
        self.chat = chat_request(body, history, front)

    def response(self, choices: list[Choice]) -> dict:
        output = output_items(choices[0])
        return self.finish(choices, output, status_of(choices[0]))

    def finish(self, choices: list[Choice], output: list[dict], status: str) -> dict:
        """The finished Response (stored when asked)."""
        response = response_object(self.body, self.id, self.created, self.front.model_name(choices), output, status,
                                   usage(choices, self.front.tokenizer))
        if self.body.store:
            messages = [m.for_template() for m in self.chat.messages]
            self.store.put(response, conversation_after(messages, output))
        return response

    def snapshot(self, choices: list[Choice], output: list[dict], status: str) -> dict:
        """The Response while it is made (a stream's first and failed events): no usage yet."""
        return response_object(self.body, self.id, self.created, self.front.model_name(choices), list(output),
                               status, None)

    def writer(self, choices: list[Choice]) -> ResponsesStreamWriter:
        return ResponsesStreamWriter(self, choices)
