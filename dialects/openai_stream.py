"""Server-sent events of the OpenAI dialect, as OpenAI sends them.

- chat: ``role`` only in a choice's first chunk; each choice ends with a chunk of an empty
  delta and its ``finish_reason``; tool calls as dialects/tool_calls.py's deltas;
- completions: the echoed prompt (and, with logprobs, its scores) in a choice's first chunk,
  the suffix in its last;
- no chunk without text or a finish reason: while a multi-byte character is incomplete the
  engine's output has no text, and its logprobs wait for the chunk that has;
- with ``stream_options.include_usage``: ``"usage": null`` on every chunk, then one chunk
  with the usage and no choices; ``data: [DONE]`` last.
"""

from __future__ import annotations

from dialects.json_types import sse_event
from dialects.openai_api import Choice, OpenAIFrontend, generated_logprobs, prompt_logprobs
from dialects.reasoning import ReasoningStream
from dialects.tool_calls import ToolCallStream
from engine.outputs import RequestOutput, TokenLogprob


class StreamWriter:
    """Turns each engine output of a choice into the SSE text to send ("" when nothing is due)."""

    def __init__(self, front: OpenAIFrontend, response_id: str, created: int, choices: list[Choice], chat: bool,
                 suffix: str = "", with_logprobs: bool = False, include_usage: bool = False) -> None:
        self.front, self.response_id, self.created, self.choices = front, response_id, created, choices
        self.chat, self.suffix, self.with_logprobs, self.include_usage = chat, suffix, with_logprobs, include_usage
        self.object_name = "chat.completion.chunk" if chat else "text_completion"
        self._started: set[int] = set()  # choice positions whose first chunk went out
        self._held: dict[int, list[TokenLogprob | int]] = {}  # logprobs waiting for text
        self._tools: dict[int, ToolCallStream] = {}  # per choice that may call tools
        self._thinking: dict[int, ReasoningStream] = {}  # per choice of a reasoning model

    def write(self, position: int, output: RequestOutput) -> str:
        choice = self.choices[position]
        first = position not in self._started
        entries = self._held.pop(position, [])
        if first and not self.chat:
            entries += prompt_logprobs(choice, output)
        entries += generated_logprobs(choice, [output])
        text = "" if choice.scores_only else output.new_text
        if self.chat:
            deltas = self._chat_deltas(position, text, output.finished)
        else:
            text = (choice.prefix if first else "") + text + (self.suffix if output.finished else "")
            deltas = [text] if text else []
        if not deltas and not output.finished:
            if entries:
                self._held[position] = entries
            return ""
        self._started.add(position)
        if not self.chat:
            finish = self.front.finish_reason(output, choice.scores_only) if output.finished else None
            logprobs = self.front.completion_logprobs(entries) if self.with_logprobs and entries else None
            return self._chunk([{"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}])
        return self._chat_events(position, output, deltas, entries, first)

    def _chat_events(self, position: int, output: RequestOutput, deltas: list[dict], entries: list, first: bool) -> str:
        """One chunk per delta (a choice's first carries the role), then, when the choice ends,
        the chunk with its finish reason; logprobs ride on the first chunk that goes out."""
        choice = self.choices[position]
        events = ""
        if output.finished:
            deltas = deltas + [{}]
        for j, delta in enumerate(deltas):
            if first:
                delta = {"role": "assistant", "content": None if "tool_calls" in delta else delta.get("content", ""),
                         **delta}
                first = False
            last = output.finished and j == len(deltas) - 1
            finish = self.front.finish_reason(output, choice.scores_only, self._called(position)) if last else None
            body = {"index": choice.index, "delta": delta, "finish_reason": finish}
            if entries:
                body["logprobs"] = self.front.chat_logprobs(entries)
                entries = []
            events += self._chunk([body])
        return events

    def _chat_deltas(self, position: int, text: str, finished: bool) -> list[dict]:
        """The thinking (reasoning_content and reasoning) first, then content or tool calls."""
        choice, deltas = self.choices[position], []
        if choice.reasoning is not None:
            stream = self._thinking.setdefault(position, ReasoningStream(choice.reasoning))
            thought, text = stream.feed(text, finished)
            if thought:
                deltas.append({"reasoning_content": thought, "reasoning": thought})
        if choice.may_call_tools:
            return deltas + self._tool_stream(position).feed(text, finished)
        return deltas + ([{"content": text}] if text else [])

    def _called(self, position: int) -> bool:
        return self.choices[position].may_call_tools and self._tool_stream(position).called

    def _tool_stream(self, position: int) -> ToolCallStream:
        return self._tools.setdefault(position, ToolCallStream())

    def close(self) -> str:
        """The usage chunk when asked for, then [DONE]."""
        usage = self._chunk([], usage=self.front.usage(self.choices)) if self.include_usage else ""
        return usage + "data: [DONE]\n\n"

    def _chunk(self, choices: list[dict], **usage) -> str:
        body = {"id": self.response_id, "object": self.object_name, "created": self.created,
                "model": self.front.model_name(self.choices), "choices": choices}
        if self.include_usage:
            body["usage"] = usage.get("usage")
        return sse_event(body)
