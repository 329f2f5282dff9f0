"""Grammars that start after the thinking: a reasoning model (Qwen3, DeepSeek-R1) writes
``<think>…</think>`` before its answer, and a request's grammar (response_format, tool calls,
structured_outputs) constrains only what follows ``</think>``, as vLLM's structured outputs do
with a reasoning parser. The thinking itself is free text.

- ``after_thinking``: a grammar's llguidance source wrapped so that it starts after the thinking.
  Where the tokenizer has the tag as one token (Qwen3's and DeepSeek-R1's added tokens, which
  llguidance treats as special), the thinking is any text up to that token, as vLLM's
  ``is_reasoning_end`` looks for its id; elsewhere (six tokens in tiny-llama's vocabulary) it is
  one lazy lexeme that ends at the first ``</think>`` in bytes, whatever tokens spell it. Either
  way the thinking is free text as llguidance sees it: valid UTF-8, no EOS before the tag.
  ``THINKS_INSIDE``: the prompt opened ``<think>`` (DeepSeek-R1's template), the output starts
  inside the thinking. ``THINKS_IF_OPENED``: the model opens ``<think>`` itself (Qwen3's); an
  output that does not start with it has no thinking, and the grammar constrains it from its
  first token (as dialects/reasoning.py splits it: all content).
- ``BudgetMatcher``: a thinking budget (Anthropic's ``budget_tokens``): once the thinking has
  taken that many output tokens, only ``</think>``'s tokens may follow, one by one.
"""

from __future__ import annotations

import json

import llguidance

THINK_START, THINK_END = "<think>", "</think>"
THINKS_INSIDE, THINKS_IF_OPENED = "inside", "if_opened"
THINK_MODES = (THINKS_INSIDE, THINKS_IF_OPENED)


def after_thinking(source: str, mode: str, start_token: int | None = None, end_token: int | None = None) -> str:
    """``source`` (llguidance's form of one grammar: a TopLevelGrammar as JSON, or Lark text) as
    the answer after the thinking: a Lark grammar whose ``@answer`` is ``source``'s grammar.
    ``start_token``, ``end_token``: the tags' ids where each is one (special) token."""
    if source.lstrip().startswith("{"):
        grammars = json.loads(source)["grammars"]
        if len(grammars) != 1:
            raise ValueError(f"after_thinking: one grammar expected, got {len(grammars)}")
        answer = {**grammars[0], "name": "answer"}
    else:
        answer = {"name": "answer", "lark_grammar": source}
    opening = f"<[{start_token}]>" if start_token is not None else '"<think>"'
    start = 'start: thinking @answer\n' if mode == THINKS_INSIDE else f'start: {opening} thinking @answer | @answer\n'
    if end_token is not None:  # text can never hold the special token: the thinking ends before it
        thinking = f'thinking: THOUGHT <[{end_token}]>\nTHOUGHT: /(?s:.*)/\n'
    else:  # free text up to the first </think> (lazy: a greedy lexeme would run past it), the tag included
        thinking = 'thinking[lazy]: /(?s:.*)/ "</think>"\n'
    return json.dumps({"grammars": [{"lark_grammar": start + thinking}, answer]})


class BudgetMatcher:
    """An llguidance matcher (of an ``after_thinking`` grammar) that ends the thinking after
    ``budget`` output tokens: then its mask allows only the next token of ``</think>``. The
    engine uses it as it uses a plain matcher (consume_tokens, compute_bitmask, is_stopped).
    ``tag_tokens``: the ids of <think> and </think> where each is one (special) token, as the
    grammar was compiled with them: then only that token opens or ends the thinking, as in the
    grammar (the same characters spelled by ordinary tokens are thinking text)."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, mode: str,
                 budget: int, tag_tokens: tuple[int | None, int | None] = (None, None)) -> None:
        self.matcher = matcher
        self._tokenizer = tokenizer
        self._mode = mode
        self._budget = budget
        self._start_token, self._end_token = tag_tokens
        self._end_ids = end_spelling(tokenizer, self._end_token)
        self._head = b""  # the output's first bytes, up to <think>'s length: did it open the tag?
        self._tail = b""  # the output's last bytes, shorter than </think>: the tag may straddle tokens
        self._first_token: int | None = None  # the output's first token, once it has one
        self._thought = 0  # output tokens of the thinking (the opening tag's too), not forced
        self._forced = 0  # tokens of </think> written because the budget ran out
        self._done = False  # the thinking ended, or the output has none: the plain matcher decides

    def _opened(self) -> bool | None:
        """Whether the output opened the thinking: None while its first bytes cannot tell yet."""
        opening = THINK_START.encode()
        if self._start_token is not None:
            return None if self._first_token is None else self._first_token == self._start_token
        if self._head[:len(opening)] == opening:
            return True
        return None if opening.startswith(self._head) else False

    def _forcing(self) -> bool:
        """Whether the next token must be </think>'s next: the output is inside its thinking
        (a qwen3 opening not yet complete is not) and the budget is spent."""
        inside = self._mode == THINKS_INSIDE or self._opened() is True
        return not self._done and inside and self._thought >= self._budget

    def consume_tokens(self, tokens: list[int]) -> bool:
        if not self.matcher.consume_tokens(tokens):
            return False
        for token in tokens:
            if self._done:
                break
            if self._first_token is None:
                self._first_token = token
            if self._forcing():
                self._forced += token == self._end_ids[self._forced]  # else: it ended a cut character
            else:
                self._thought += 1
            piece = self._tokenizer.decode_bytes([token])
            self._head = (self._head + piece)[:len(THINK_START)]
            if self._end_token is not None:
                ended = token == self._end_token
            else:
                window = self._tail + piece
                ended = THINK_END.encode() in window
                self._tail = window[-(len(THINK_END) - 1):]
            self._done = ended or (self._mode == THINKS_IF_OPENED and self._opened() is False)
        return True

    def compute_bitmask(self) -> bytes:
        mask = self.matcher.compute_bitmask()
        if not self._forcing():
            return mask
        token = self._end_ids[self._forced]
        bit = 1 << (token % 8)  # bit token % 32 of int32 word token // 32, little-endian: byte token // 8
        if not mask[token // 8] & bit:  # the thinking stops inside a UTF-8 character: it ends it first
            return mask
        forced = bytearray(len(mask))
        forced[token // 8] = bit
        return bytes(forced)

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def get_error(self) -> str:
        return self.matcher.get_error()


def end_spelling(tokenizer: llguidance.LLTokenizer, end_token: int | None) -> list[int]:
    """The tokens a budget forces to end the thinking: the one </think> token where the model has
    it, else ordinary tokens whose bytes are exactly ``</think>``; ValueError if there are none."""
    return [end_token] if end_token is not None else _spelling(tokenizer, THINK_END)


def _spelling(tokenizer: llguidance.LLTokenizer, text: str) -> list[int]:
    """Token ids whose bytes are exactly ``text`` (no leading-space marker)."""
    ids = tokenizer.tokenize_str(text)
    if tokenizer.decode_bytes(ids) != text.encode():
        ids = tokenizer.greedy_tokenize(text)
    if tokenizer.decode_bytes(ids) != text.encode():
        raise ValueError(f"the tokenizer cannot spell {text!r} exactly")
    return ids
