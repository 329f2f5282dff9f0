"""Per-request generation controls, validated once when a request is built.

One object carries every control a request can set, as vLLM's ``SamplingParams`` does:
the sampling controls (temperature, top-k/top-p/min-p, penalties, biases, seed, logprobs)
and the stop conditions (length limits, EOS, stop token sequences and stop strings).
Invalid values raise ``ValueError`` whose message starts with the field's name, so an
API layer can turn it into a 4xx that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sampling.grammar import Grammar

MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: length ** penalty must stay a float for any output length
BEAM_EXCLUSIVE = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "no_repeat_ngram_size", "bad_words_ids", "logit_bias", "min_new_tokens",
                  "stop_token_ids", "stop", "grammar", "seed", "prompt_logprobs")


@dataclass
class SamplingParams:
    max_new_tokens: int = 20
    min_new_tokens: int = 0
    temperature: float = 1.0
    # None: greedy exactly when temperature == 0 or top_k == 1 (docs/sampling.md).
    do_sample: bool | None = None
    top_k: int = 0  # 0 = off; k >= vocab size is off as well
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # transformers' semantics, over prompt and output
    presence_penalty: float = 0.0  # OpenAI's semantics, over the output
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # None: the engine draws one and reports it
    logprobs: int | None = None  # None = off; N = chosen token's logprob plus the top N
    # None = off; N = every prompt token's logprob (the model's raw distribution; the first
    # token has none) plus the top N at its position. Such a prompt is computed whole, never
    # taken from the prefix cache: cached blocks hold KV, not the logits that score it.
    prompt_logprobs: int | None = None
    # TensorRT-LLM's raw logits (float32, before any processor): the prompt's, one row per prompt
    # token (computed whole, like prompt_logprobs), and each generated token's.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    ignore_eos: bool = False
    eos_token_id: int | None = None  # overrides the model's EOS (TensorRT-LLM's end_id)
    stop_token_ids: list[list[int]] = field(default_factory=list)  # token-id sequences
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string that matched
    skip_special_tokens: bool = True
    grammar: Grammar | None = None  # the output must match it (sampling/grammar.py)
    # Beam search (engine/decoding/beam_search.py): width 1 is off. Beams score the model's own
    # log-probabilities, so no control that reshapes them combines with it (BEAM_EXCLUSIVE).
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # transformers' values: True, False (a heuristic), "never"

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        _check(self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0")
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables top-k)")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size", "must be >= 0")
        _check(self.seed is None or 0 < self.seed <= MAX_SEED, "seed", f"must be in (0, {MAX_SEED}]")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(all(len(w) > 0 for w in self.bad_words_ids), "bad_words_ids", "sequences must be non-empty")
        _check(all(len(s) > 0 for s in self.stop_token_ids), "stop_token_ids", "sequences must be non-empty")
        _check(all(len(s) > 0 for s in self.stop), "stop", "strings must be non-empty")
        _check(self.beam_width >= 1, "beam_width", "must be >= 1")
        _check(abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
               f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        _check(self.early_stopping in (True, False, "never"), "early_stopping", "must be true, false or 'never'")
        if self.beam_width > 1:
            for name in self.beam_conflicts():
                raise ValueError(f"{name}: does not combine with beam search (beam_width > 1)")
        # Once the grammar is complete only EOS may follow; a minimum length would forbid it.
        _check(self.grammar is None or self.min_new_tokens == 0, "min_new_tokens",
               "cannot be combined with a grammar (response_format): it could forbid the only token allowed")

    def beam_conflicts(self) -> list[str]:
        """The fields set away from their defaults that beam search cannot honour: they sample,
        or reshape the distribution the beams are scored on."""
        defaults = SamplingParams()
        conflicts = [name for name in BEAM_EXCLUSIVE if getattr(self, name) != getattr(defaults, name)]
        return conflicts + (["logprobs"] if self.logprobs else [])  # each beam's token logprobs only, no top-N

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (no random draw)."""
        if self.do_sample is not None:
            return not self.do_sample or self.temperature == 0.0
        return self.temperature == 0.0 or self.top_k == 1

    def token_ids_in_use(self) -> list[int]:
        """Every token id the request names, for checks against the vocabulary."""
        ids = list(self.logit_bias)
        for seq in (*self.bad_words_ids, *self.stop_token_ids):
            ids.extend(seq)
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``: choice 0 keeps it, the
    others take the next ones (wrapping within [1, MAX_SEED]); independent and reproducible.
    None for an unseeded request: the engine draws each choice's seed (and reports it)."""
    if seed is None:
        return None
    return seed if index == 0 else (seed + index - 1) % MAX_SEED + 1


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}")
