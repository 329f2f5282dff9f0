"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}): its request
(dialects/responses_schema.py) becomes the chat request (dialects/openai_schema.py
ChatCompletionRequest), so the chat template, the tools grammar, json_schema output, stop strings,
limits and priorities are chat's own; the chat answer becomes Responses' output items, whole or as
OpenAI's stream events. Stored responses live here too (``ResponseStore``). docs/api.md has each
decision.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
import time
import uuid

from dialects import through_chat
from dialects.errors import APIError
from dialects.json_types import sse_event
from dialects.openai_api import Choice, OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.responses_schema import FunctionCallItem, MessageItem, NamedFunction, ResponsesRequest
from engine.outputs import LENGTH, TIMEOUT, RequestOutput


# ---- into the chat request ----------------------------------------------------------------------


def chat_messages(items: list) -> list[dict]:
    """Input items as chat messages: function calls join the assistant turn before them (or make
    one), their outputs become tool messages."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    for message in messages:  # an assistant turn of calls only has no content (chat's rule)
        if message["role"] == "assistant" and message.get("tool_calls") and not message["content"]:
            message["content"] = None
    return messages


def chat_request(body: ResponsesRequest, history: list[dict], front: OpenAIFrontend) -> ChatCompletionRequest:
    """The one internal request chat uses: ``history`` (the stored conversation before
    ``previous_response_id``, instructions excluded) then the input, after ``instructions`` and
    the input's own leading system messages, joined as the one system message."""
    if body.max_output_tokens is not None and body.max_output_tokens > front.max_iter_times:
        raise APIError(400, f"max_output_tokens: must be in (0, {front.max_iter_times}] (max_iter_times)",
                       "max_output_tokens", "invalid_value")
    messages = history + chat_messages(body.items())
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
              if body.text is not None and body.text.format is not None else None}
    return through_chat.chat_request(fields, {"messages": "input", "response_format": "text.format",
                                              "max_completion_tokens": "max_output_tokens"})


# ---- the answer as output items ---------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(choice: Choice) -> list[dict]:
    """The whole answer: its text as a message (when there is any), then one item per call."""
    message, _ = OpenAIFrontend.chat_message(choice)
    status = status_of(choice)
    items = [message_item(new_id("msg"), message["content"], status)] if message["content"] else []
    items += [function_call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], status)
              for c in message.get("tool_calls", [])]
    return items


def usage(choices: list[Choice]) -> dict:
    counts = OpenAIFrontend.usage(choices)
    return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
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
    }


def status_of(choice: Choice) -> str:
    """"incomplete" when the answer ended at max_output_tokens (or the model's length), not by itself."""
    return "incomplete" if choice.final.finish_reason in (LENGTH, TIMEOUT) else "completed"


# ---- what the ingress keeps ------------------------------------------------------------------------


def conversation_after(messages: list[dict], output: list[dict]) -> list[dict]:
    """The chat messages a later previous_response_id continues from: this request's, without its
    system message (instructions are not carried over), then the answer's."""
    kept = [m for m in messages if m["role"] != "system"]
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    if calls:
        kept.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif text:  # an empty answer leaves no turn (chat takes no empty message)
        kept.append({"role": "assistant", "content": text})
    return kept


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
                                   usage(choices))
        if self.body.store:
            messages = [m.for_template() for m in self.chat.messages]
            self.store.put(response, conversation_after(messages, output))
        return response

    def writer(self, choices: list[Choice]) -> ResponsesStreamWriter:
        return ResponsesStreamWriter(self, choices)


class ResponsesStreamWriter(through_chat.DeltaWriter):
    """OpenAI's event sequence: response.created, response.in_progress; per output item
    output_item.added, then for a message content_part.added, output_text.delta..., output_text.done,
    content_part.done, and for a call function_call_arguments.delta..., .done; output_item.done;
    last response.completed (or response.incomplete; response.failed on an error after the start).
    Every event carries its ``sequence_number`` and its SSE ``event:`` name."""

    def __init__(self, exchange: ResponsesExchange, choices: list[Choice]) -> None:
        super().__init__(choices)
        self.exchange = exchange
        self._sequence = 0
        self._output: list[dict] = []  # items so far; the last may be open
        self._open = False

    def _start_events(self) -> str:
        response = self._response([], "in_progress")
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                   response=response)

    def _finish(self, output: RequestOutput) -> str:
        status = status_of(self.choices[0])
        events = self._close_item(status)
        return events + self._event(f"response.{status}", response=self.exchange.finish(self.choices, self._output,
                                                                                          status))

    def fail(self, error: APIError) -> str:
        """An error after the stream began: the response failed, with the error's code and message."""
        response = self._response(self._output, "failed")
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return self._event("response.failed", response=response)

    def _delta(self, delta: dict) -> str:
        if "content" in delta:
            events = ""
            if not self._open or self._output[-1]["type"] != "message":
                events += self._close_item("completed")
                events += self._add_item(message_item(new_id("msg"), "", "in_progress"))
                events += self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=output_text(""))
            self._output[-1]["content"][0]["text"] += delta["content"]
            return events + self._event("response.output_text.delta", **self._where(), content_index=0,
                                        delta=delta["content"], logprobs=[])
        (call,) = delta["tool_calls"]
        if "id" in call:  # a new call: its first delta names it
            return self._close_item("completed") + self._add_item(
                function_call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
        self._output[-1]["arguments"] += call["function"]["arguments"]
        return self._event("response.function_call_arguments.delta", **self._where(),
                           delta=call["function"]["arguments"])

    def _add_item(self, item: dict) -> str:
        self._output.append(item)
        self._open = True
        return self._event("response.output_item.added", output_index=len(self._output) - 1, item=dict(item))

    def _close_item(self, status: str) -> str:
        if not self._open:
            return ""
        self._open = False
        item = self._output[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = self._event("response.output_text.done", **self._where(), content_index=0, text=part["text"],
                                 logprobs=[])
            events += self._event("response.content_part.done", **self._where(), content_index=0, part=part)
        else:
            events = self._event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                 arguments=item["arguments"])
        return events + self._event("response.output_item.done", output_index=len(self._output) - 1, item=item)

    def _where(self) -> dict:
        return {"item_id": self._output[-1]["id"], "output_index": len(self._output) - 1}

    def _response(self, output: list[dict], status: str) -> dict:
        return response_object(self.exchange.body, self.exchange.id, self.exchange.created,
                               self.exchange.front.model_name(self.choices), list(output), status, None)

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\n{sse_event(body)}"
