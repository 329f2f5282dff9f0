"""Reasoning output: models that think in ``<think>…</think>`` before they answer (Qwen3,
DeepSeek-R1 and their distillations). The text between the tags goes to ``reasoning_content``
(and vLLM's newer name, ``reasoning``), the rest to ``content``, in whole messages and in stream
deltas alike. docs/api.md has the decisions.

- ``reasoning_parser``: one per model family, chosen by the served chat template: none when the
  template has no ``<think>``; "deepseek_r1" when its generation prompt opens ``<think>`` itself
  (the output starts inside the reasoning); "qwen3" when the model opens it (an output that does
  not start with ``<think>`` is all content).
- ``ReasoningParser.split``: a whole output; ``ReasoningStream``: the same split as text arrives,
  holding back what may be the start of a tag, so the deltas joined equal the whole split.
"""

from __future__ import annotations

from dataclasses import dataclass

from sampling.reasoning_grammar import THINK_END, THINK_START

FAMILIES = ("qwen3", "deepseek_r1")


def template_texts(chat_template: object) -> list[str]:
    """A tokenizer's chat template(s) as text (one, or a dict of named ones)."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return [t for t in templates if isinstance(t, str)]


def template_mentions(chat_template: object, name: str) -> bool:
    """Whether the template reads ``name`` (a chat_template_kwargs key, reasoning_effort)."""
    return any(name in t for t in template_texts(chat_template))


def reasoning_parser(chat_template: object, generation_prompt: str) -> ReasoningParser | None:
    """The parser for the served template; ``generation_prompt``: the template's rendering of one
    user message with add_generation_prompt (it shows whether the prompt opens the thinking)."""
    if not template_mentions(chat_template, THINK_START):
        return None
    return ReasoningParser("deepseek_r1" if generation_prompt.rstrip().endswith(THINK_START) else "qwen3")


def _hold_back(text: str, tag: str) -> str:
    """``text`` without its longest ending that could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size]
    return text


@dataclass(frozen=True)
class ReasoningParser:
    family: str  # one of FAMILIES

    def progress(self, text: str, finished: bool) -> tuple[str | None, str]:
        """(reasoning, content) of ``text`` that can be sent now: all of it once ``finished``;
        before, nothing that may yet turn out to be a tag. reasoning is None when the output
        does not think (qwen3's, once it is clear that it does not start with ``<think>``)."""
        if not finished and THINK_START.startswith(text):  # "<thi": it may yet open the tag
            return "", ""
        if self.family == "qwen3" and not text.startswith(THINK_START):
            return None, text  # an answer without thinking: a later "</think>" is just text
        body = text.removeprefix(THINK_START)
        if THINK_END in body:
            reasoning, _, content = body.partition(THINK_END)
            return reasoning, content
        return (body if finished else _hold_back(body, THINK_END)), ""

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (reasoning, content); the output is THINK_START (when the model wrote
        it) + reasoning + THINK_END + content."""
        return self.progress(text, finished=True)


class ReasoningStream:
    """One choice's reasoning and content deltas as its text grows."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the content to send now (either may be "")."""
        self.text += new_text
        reasoning, content = self.parser.progress(self.text, finished)
        reasoning = reasoning or ""
        thought, said = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return thought, said
