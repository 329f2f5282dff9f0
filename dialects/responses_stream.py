"""Responses' output items (dialects/responses.py builds the whole answer from them) and the
stream of events that writes them as the answer arrives: a reasoning item (a reasoning model's
thinking), a message item (the text), one function_call item per call, in that order.
docs/api.md has each decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
import uuid

from dialects import through_chat
from dialects.errors import APIError
from dialects.json_types import sse_event
from dialects.openai_api import Choice
from engine.outputs import LENGTH, TIMEOUT, RequestOutput

if TYPE_CHECKING:
    from dialects.responses import ResponsesExchange

# The items that hold one text part, and the prefix of their text's events (….delta, ….done).
TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(choice: Choice) -> str:
    """"incomplete" when the answer ended at max_output_tokens (or the model's length), not by itself."""
    return "incomplete" if choice.final.finish_reason in (LENGTH, TIMEOUT) else "completed"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The model's thinking as OpenAI's reasoning item: the text itself as reasoning_text content
    (as vLLM returns an open model's thinking), no summary, nothing encrypted."""
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [text_part("reasoning", text)],
            "status": status}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part("message", text)]}


def text_part(kind: str, text: str) -> dict:
    """The one text part of a reasoning or message item."""
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


ITEM_PREFIXES = {"reasoning": "rs", "message": "msg"}
NEW_ITEMS = {"reasoning": reasoning_item, "message": message_item}


class ResponsesStreamWriter(through_chat.DeltaWriter):
    """OpenAI's event sequence: response.created, response.in_progress; per output item
    output_item.added (its content still empty), then for a reasoning item content_part.added
    (reasoning_text), reasoning_text.delta..., reasoning_text.done, content_part.done; for a
    message content_part.added (output_text), output_text.delta..., output_text.done,
    content_part.done; for a call function_call_arguments.delta..., .done; output_item.done; last
    response.completed (or response.incomplete; response.failed on an error after the start).
    Every event carries its ``sequence_number`` (0, 1, ... in the order sent) and its SSE
    ``event:`` name. An item closes when the next opens: it is completed then; the last takes
    the answer's status."""

    def __init__(self, exchange: ResponsesExchange, choices: list[Choice]) -> None:
        super().__init__(choices, split_reasoning=True)
        self.exchange = exchange
        self._sequence = 0
        self._output: list[dict] = []  # items so far; the last may be open
        self._open = False

    def _start_events(self) -> str:
        response = self.exchange.snapshot(self.choices, [], "in_progress")
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                   response=response)

    def _finish(self, output: RequestOutput) -> str:
        status = status_of(self.choices[0])
        events = self._close_item(status)
        return events + self._event(f"response.{status}", response=self.exchange.finish(self.choices, self._output,
                                                                                          status))

    def fail(self, error: APIError) -> str:
        """An error after the stream began: the response failed, with the error's code and message."""
        response = self.exchange.snapshot(self.choices, self._output, "failed")
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return self._event("response.failed", response=response)

    def _delta(self, delta: dict) -> str:
        if "reasoning" in delta or "content" in delta:
            kind, text = ("reasoning", delta["reasoning"]) if "reasoning" in delta else ("message", delta["content"])
            events = ""
            if not self._open or self._output[-1]["type"] != kind:
                events += self._close_item("completed") + self._add_item(NEW_ITEMS[kind](
                    new_id(ITEM_PREFIXES[kind]), "", "in_progress"))
            self._output[-1]["content"][0]["text"] += text
            logprobs = {"logprobs": []} if kind == "message" else {}
            return events + self._event(f"{TEXT_EVENTS[kind]}.delta", **self._where(), content_index=0, delta=text,
                                        **logprobs)
        (call,) = delta["tool_calls"]
        if "id" in call:  # a new call: its first delta names it
            return self._close_item("completed") + self._add_item(
                function_call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
        self._output[-1]["arguments"] += call["function"]["arguments"]
        return self._event("response.function_call_arguments.delta", **self._where(),
                           delta=call["function"]["arguments"])

    def _add_item(self, item: dict) -> str:
        """output_item.added with the item's content empty, then (reasoning, message) its text part's
        content_part.added, as OpenAI sends them."""
        self._output.append(item)
        self._open = True
        if item["type"] not in TEXT_EVENTS:
            return self._event("response.output_item.added", output_index=len(self._output) - 1, item=dict(item))
        return self._event("response.output_item.added", output_index=len(self._output) - 1,
                           item={**item, "content": []}) + \
            self._event("response.content_part.added", **self._where(), content_index=0, part=dict(item["content"][0]))

    def _close_item(self, status: str) -> str:
        if not self._open:
            return ""
        self._open = False
        item = self._output[-1]
        item["status"] = status
        if item["type"] in TEXT_EVENTS:
            part = item["content"][0]
            logprobs = {"logprobs": []} if item["type"] == "message" else {}
            events = self._event(f"{TEXT_EVENTS[item['type']]}.done", **self._where(), content_index=0,
                                 text=part["text"], **logprobs)
            events += self._event("response.content_part.done", **self._where(), content_index=0, part=part)
        else:
            events = self._event("response.function_call_arguments.done", **self._where(), name=item["name"],
                                 arguments=item["arguments"])
        return events + self._event("response.output_item.done", output_index=len(self._output) - 1, item=item)

    def _where(self) -> dict:
        return {"item_id": self._output[-1]["id"], "output_index": len(self._output) - 1}

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\n{sse_event(body)}"
