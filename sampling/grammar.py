"""Grammar-constrained decoding: which tokens a request may take next, as a packed bitmask.

A request's ``SamplingParams.grammar`` is plain data (``Grammar``: a kind and its text) so it
travels through P and D like every other control. Each engine turns it into a matcher with
llguidance, the grammar engine behind this one seam:

    compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_ids)
    compiler.check(grammar)                    # compile once per digest; ValueError naming the field
    matcher = compiler.matcher(grammar, ids)   # a copy of the compiled one, advanced by ``ids``
    compiler.bitmask(matcher)                  # [W] int32: bit t % 32 of word t // 32 = token t allowed
    matcher.consume_tokens(new_ids)            # after each accepted token (MatcherState counts them)

A matcher is rebuilt from a sequence's output ids wherever that sequence lives (D after P's first
token, a choice after its fork), so nothing but token ids crosses processes. The sampler applies
the mask before everything else (sampling/sampler.py), so logprobs are those of the constrained
distribution, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import json
import threading

import llguidance
import llguidance.hf  # not llguidance.torch: importing it loads torch._dynamo (~1.5 s a process)
import torch

from sampling.reasoning_grammar import THINK_END, THINK_MODES, THINK_START, BudgetMatcher, after_thinking, end_spelling

Matcher = llguidance.LLMatcher
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark", "text")
# JSON as json.dumps writes it: ", " and ": " and no other whitespace. Free whitespace lets a weak
# model pad until max_tokens without ever closing the object (vLLM offers the same switch). A
# schema inside a Lark grammar carries them as its "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. ``kind``: "json_object" (any JSON object; ``text`` is
    empty), "json_schema" (``text`` is the schema as JSON), "regex" (``text`` is a regular
    expression the whole output matches) or "lark" (``text`` is a grammar in llguidance's Lark
    syntax, which may embed schemas: tool calls, dialects/tool_calls.py; choice lists) or "text"
    (any text: only with a thinking budget). ``field`` names the request field it came from, for
    error messages. ``thinking`` (sampling/reasoning_grammar.py THINK_MODES): the output thinks
    first and the grammar starts after ``</think>``; ``thinking_budget``: at most that many
    output tokens of thinking, then ``</think>`` is written."""

    kind: str
    text: str = ""
    field: str = "grammar"
    thinking: str | None = None
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"{self.field}: kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if self.thinking is not None and self.thinking not in THINK_MODES:
            raise ValueError(f"{self.field}: thinking must be one of {', '.join(THINK_MODES)}, got {self.thinking!r}")
        if self.thinking_budget is not None and (self.thinking is None or self.thinking_budget < 1):
            raise ValueError(f"{self.field}: a thinking budget is at least 1 token, and needs thinking")

    @property
    def digest(self) -> str:
        # The budget is not part of the compiled grammar: BudgetMatcher applies it to a copy.
        return hashlib.sha256(f"{self.kind}\0{self.text}\0{self.thinking}".encode()).hexdigest()

    def source(self, tag_tokens: tuple[int | None, int | None] = (None, None)) -> str:
        """The grammar in llguidance's form, after the thinking when the output thinks first;
        ``tag_tokens``: the ids of <think> and </think> where each is one token of the model's
        (GrammarCompiler knows them; without a tokenizer the tags are text)."""
        source = self._answer_source()
        return source if self.thinking is None else after_thinking(source, self.thinking, *tag_tokens)

    def _answer_source(self) -> str:
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "text":
            return llguidance.LLMatcher.grammar_from_lark("start: TEXT\nTEXT: /(?s:.*)/\n")
        schema = self.text if self.kind == "json_schema" else json.dumps({"type": "object"})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as error:
            raise ValueError(f"{self.field}: not a JSON object: {error}") from None


class GrammarDeadEnd(RuntimeError):
    """A matcher refused a token its own mask allowed: the request cannot go on (never seen;
    the engine ends that request alone rather than its whole batch)."""


@dataclass
class MatcherState:
    """A request's matcher and how many of its output tokens it has consumed."""

    matcher: Matcher
    consumed: int = 0


def check_grammar(grammar: Grammar) -> None:
    """Raise ValueError naming ``grammar.field`` if the grammar engine cannot compile it (an
    unsupported keyword, an impossible schema). Needs no model: the API layer calls it."""
    error = llguidance.LLMatcher.validate_grammar(grammar.source())
    if error:
        raise ValueError(f"{grammar.field}: the grammar engine cannot use it: {_first_line(error)}")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


class GrammarCompiler:
    """One model's grammars: the tokenizer in llguidance's form and each compiled grammar, by
    digest. ``check`` compiles (callers run it off the engine's step loop); the step loop only
    copies compiled matchers and computes masks."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._eos = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: dict[str, Matcher] = {}
        self._lock = threading.Lock()  # check() runs on server threads, matcher() on the engine's

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:  # ~10 ms for tiny-llama, ~1 s for a 150k vocabulary: on first use
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
            return self._tokenizer

    def _tag_tokens(self) -> tuple[int | None, int | None]:
        """The ids of <think> and </think> where the tokenizer has each as one (special) token."""
        tokenizer = self.tokenizer()
        ids = [self._hf_tokenizer.convert_tokens_to_ids(tag) for tag in (THINK_START, THINK_END)]
        return tuple(i if isinstance(i, int) and i != self._hf_tokenizer.unk_token_id and i < self.vocab_size
                     and tokenizer.is_special_token(i) else None for i in ids)

    def check(self, grammar: Grammar) -> None:
        """Compile ``grammar`` for this model unless it is cached; ValueError naming its field."""
        if grammar.thinking_budget is not None:  # refused here, not on the engine thread mid-step
            try:
                end_spelling(self.tokenizer(), self._tag_tokens()[1])
            except ValueError as error:
                raise ValueError(f"{grammar.field}: a thinking budget needs </think> in tokens: {error}") from None
        if grammar.digest in self._compiled:
            return
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar.source(self._tag_tokens()), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{grammar.field}: the grammar engine cannot use it: "
                             f"{_first_line(matcher.get_error())}")
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():  # an empty language: no first token (e.g. the regex [^\s\S])
            raise ValueError(f"{grammar.field}: the grammar engine cannot use it: no output matches it")
        with self._lock:
            self._compiled[grammar.digest] = matcher

    def matcher(self, grammar: Grammar, token_ids: list[int]) -> Matcher | BudgetMatcher:
        """A fresh matcher for ``grammar`` that has consumed ``token_ids`` (the output so far)."""
        self.check(grammar)
        matcher = self._compiled[grammar.digest].deep_copy()
        if grammar.thinking_budget is not None:
            matcher = BudgetMatcher(matcher, self.tokenizer(), grammar.thinking, grammar.thinking_budget,
                                    self._tag_tokens())
        if token_ids and not matcher.consume_tokens(token_ids):
            raise ValueError(f"{grammar.field}: the tokens so far do not match it: {matcher.get_error()}")
        return matcher

    def bitmask(self, matcher: Matcher | BudgetMatcher) -> torch.Tensor:
        """The tokens ``matcher`` allows next: [W] int32 on the CPU."""
        return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)  # [W]


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack [R, W] int32 bitmasks into [R, V] bool: bit t % 32 of word t // 32 = token t allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    unpacked = (bitmask[:, :, None] >> bits) & 1  # [R, W, 32]
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
