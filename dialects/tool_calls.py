"""Tool calling in Hermes' syntax, the one Qwen2.5/3 and Hermes models are trained on: each call
is ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``, calls one per line.

- ``tools_grammar``: what the output may be, as a grammar for constrained decoding.
  ``required`` and a named function: calls only, from the first token. ``auto``: free text
  that never contains ``<tool_call>``, or text then calls; once ``<tool_call>\\n`` is written
  the rest must be calls whose arguments validate against their function's ``parameters``.
  ``parallel`` false: at most one call.
- ``parse_tool_calls``: an output (whole or so far) into its text content and its calls.
- ``ToolCallStream``: the OpenAI stream deltas of one choice, as its text grows.

The JSON is written as json.dumps writes it (sampling/grammar.py's JSON_OPTIONS), so a call's
``arguments`` are the text between ``"arguments": `` and the brace that balances it.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
import re
import uuid

from sampling.grammar import JSON_OPTIONS, Grammar

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEP = "\n"
_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]*)(")?(, "arguments": )?')


def template_has_tool_syntax(chat_template: object) -> bool:
    """Whether a chat template teaches the model Hermes' syntax (then ``auto`` can be parsed)."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(t, str) and "<tool_call>" in t for t in templates)


def tools_grammar(functions: dict[str, dict], choice: str, parallel: bool) -> Grammar:
    """The grammar of an output that calls ``functions`` (name -> parameters schema).
    ``choice``: "auto", "required", or a function's name (that function only)."""
    names = [choice] if choice not in ("auto", "required") else list(functions)
    # One schema per function: each is its own document, so its "$ref"s resolve in it.
    bodies = "".join(f"call_{j}: %json {json.dumps(_call_schema(name, functions[name]))}\n"
                     for j, name in enumerate(names))
    more = f'("{_lark(CALL_SEP + CALL_OPEN)}" call_body CLOSE)*' if parallel else ""
    calls = f'call_body CLOSE {more}'
    if choice == "auto":
        # PLAIN never contains the opening tag; ``lead`` (lazy: it ends at the first tag) is text
        # then the tag. A call that has begun can only go on as a call.
        start = (f"start: PLAIN | lead {calls}\n"
                 f'lead[lazy]: PLAIN "{_lark(CALL_OPEN)}"\n'
                 f'PLAIN: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_OPEN.strip())}(?s:.*)/\n')
    else:
        start = f'start: "{_lark(CALL_OPEN)}" {calls}\n'
    alternatives = " | ".join(f"call_{j}" for j in range(len(names)))
    lark = start + f'CLOSE: "{_lark(CALL_CLOSE)}"\ncall_body: {alternatives}\n' + bodies
    return Grammar("lark", lark, "tools")


def _call_schema(name: str, parameters: dict) -> dict:
    """A call's JSON: {"name": name, "arguments": an object of ``parameters``}. The parameters'
    definitions move to the root, where their "#/$defs/..." references point."""
    arguments = dict(parameters)
    definitions = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {**definitions, "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": arguments}, "x-guidance": JSON_OPTIONS}


def _lark(text: str) -> str:
    """``text`` inside a Lark string literal."""
    return json.dumps(text)[1:-1]


@dataclass
class ParsedCall:
    """One call as far as it has been written: ``name`` once complete, ``arguments`` so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False  # the arguments' closing brace has been written


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """``text`` (an output, whole or so far) as (content before the first call, calls)."""
    content, opened, rest = text.partition(CALL_OPEN)
    calls = []
    while opened:
        call, rest = _parse_call(rest)
        calls.append(call)
        if not call.complete:
            break
        _, opened, rest = rest.partition(CALL_SEP + CALL_OPEN)  # past this call's close
    return content, calls


def _parse_call(text: str) -> tuple[ParsedCall, str]:
    """A call's body from its start: the call, and the text after its arguments."""
    head = _HEAD.match(text)
    if head is None or head.group(2) is None:
        return ParsedCall(None), ""
    name = head.group(1)
    if head.group(3) is None:
        return ParsedCall(name), ""
    start = head.end()
    end = _json_value_end(text, start)
    if end is None:
        return ParsedCall(name, text[start:]), ""
    return ParsedCall(name, text[start:end], complete=True), text[end:]


def _json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object starting at ``text[start]`` ends (one past its brace), None while open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(calls: list[ParsedCall]) -> list[dict]:
    """A whole answer's calls as OpenAI's ``message.tool_calls`` (a call cut off before its name
    is dropped; one cut off in its arguments keeps them as far as they go, as when streamed)."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.name is not None]


class ToolCallStream:
    """One choice's deltas as its output grows: text content first (held back while it could be
    the start of ``<tool_call>``), then per call a first delta with index, id, type and name,
    and its arguments in pieces."""

    def __init__(self) -> None:
        self.text = ""
        self._content_sent = 0
        self._arguments_sent: list[int] = []  # per call whose first delta went out

    @property
    def called(self) -> bool:
        return bool(self._arguments_sent)

    def feed(self, new_text: str, finished: bool) -> list[dict]:
        """The deltas due after ``new_text``: each {"content": ...} or {"tool_calls": [...]}."""
        self.text += new_text
        content, calls = parse_tool_calls(self.text)
        if not calls and not finished:  # keep back what may be the tag's beginning
            content = content[:len(content) - _tag_prefix_length(content)]
        deltas = []
        if len(content) > self._content_sent:
            deltas.append({"content": content[self._content_sent:]})
            self._content_sent = len(content)
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self._arguments_sent):
                self._arguments_sent.append(0)
                deltas.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self._arguments_sent[index]:
                piece = call.arguments[self._arguments_sent[index]:]
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                self._arguments_sent[index] = len(call.arguments)
        return deltas


def _tag_prefix_length(text: str) -> int:
    """The length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(CALL_OPEN), len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
