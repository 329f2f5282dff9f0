"""What the dialects that speak through the chat request (dialects/responses.py,
dialects/anthropic.py) share: making that request from their fields, with its errors naming
their own fields, and writing their streams from chat's deltas."""

from __future__ import annotations

from pydantic import ValidationError

from dialects.errors import APIError
from dialects.openai_api import Choice
from dialects.openai_schema import ChatCompletionRequest
from dialects.reasoning import ReasoningStream
from dialects.tool_calls import ToolCallStream
from engine.outputs import RequestOutput


def chat_request(fields: dict, renames: dict[str, str]) -> ChatCompletionRequest:
    """The chat request of ``fields`` (None and empty values left out). What only the
    conversation as a whole shows (a tool output that answers no call, a system message late)
    is a 400 whose ``param`` is the dialect's name for chat's field (``renames``; "messages" for
    any message)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v not in (None, [])})
    except ValidationError as error:
        first = error.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        field = ".".join(map(str, first["loc"]))
        if not field:  # a check across fields names its field in its message: "<field>: <rule>"
            field, _, message = message.partition(": ")
        field = "messages" if field.startswith("messages") else field
        param = renames.get(field, field)
        raise APIError(400, f"{param}: {message}", param, "invalid_value") from None


def located(prefix: str, error: ValidationError) -> ValueError:
    """A nested item's first error as "<prefix>.<field>: <rule>", the schemas' way of naming a
    field inside a list (the request's validation error handler prefixes the list's name)."""
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("list[", "str")))
    message = first["msg"].removeprefix("Value error, ")  # a check of the item's own: "<field>: <rule>"
    return ValueError(f"{prefix}.{where}: {message}" if where else f"{prefix}.{message}")


class DeltaWriter:
    """A dialect's stream of one chat answer, written from chat's deltas (dialects/tool_calls.py
    ToolCallStream: text content, then each call's name and its arguments in pieces). A dialect
    says what its stream opens with (``_start_events``, sent with the first output, which is in
    hand when the stream starts), what each delta is (``_delta``) and how the stream ends
    (``_finish``)."""

    def __init__(self, choices: list[Choice], split_reasoning: bool = False) -> None:
        """``split_reasoning``: a reasoning model's thinking comes as ``{"reasoning": text}``
        deltas before the answer's (dialects/reasoning.py splits it as chat does)."""
        self.choices = choices
        self._tools = ToolCallStream() if choices[0].may_call_tools else None
        reasoning = choices[0].reasoning if split_reasoning else None
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._started = False

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def write(self, position: int, output: RequestOutput) -> str:
        events = "" if self._started else self._start_events()
        self._started = True
        text = output.new_text
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(text, output.finished)
            events += self._delta({"reasoning": thought}) if thought else ""
        deltas = self._tools.feed(text, output.finished) if self._tools else [{"content": text}] if text else []
        events += "".join(self._delta(delta) for delta in deltas)
        return events + (self._finish(output) if output.finished else "")

    def close(self) -> str:
        """Nothing after the last output: ``_finish`` ended the stream."""
        return ""

    def _start_events(self) -> str:
        raise NotImplementedError

    def _delta(self, delta: dict) -> str:
        raise NotImplementedError

    def _finish(self, output: RequestOutput) -> str:
        raise NotImplementedError
