"""What the engine hands back: per-step request outputs and prefill results."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from engine.kv_transfer import KVPayload

# Finish reasons. MindIE's values, plus the two ends a caller causes.
EOS = "eos_token"
STOP = "stop_sequence"
LENGTH = "length"
ABORT = "abort"  # abort(request_id): a cancellation or a client that went away
TIMEOUT = "timeout"  # the request's deadline passed


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N alternatives, (id, logprob)


class Sampled(NamedTuple):
    """One sampled row of a step: the token, its logprob when asked for, its raw logits [1, V] when asked for."""

    token_id: int
    logprob: TokenLogprob | None
    logits: np.ndarray | None


@dataclass
class ChoiceStart:
    """A choice that goes on to D: its first token (sampled on P) and its seed."""

    index: int
    first_token_id: int
    first_logprob: TokenLogprob | None
    seed: int


@dataclass
class PrefillResult:
    """What P hands to D: the prompt's KV once, and the first token of each choice still going."""

    request_id: str
    choices: list[ChoiceStart]
    kv: KVPayload
    prefill_time_ms: float  # arrival at P to the first token
    # Beam search: P made the first step; ``choices`` are the running beams, best first, and this
    # is the search's state after it (engine/decoding/beam_search.py BeamState).
    beam_state: Any = None
    beam_logits: np.ndarray | None = None  # [V]: the first step's raw logits, when generation logits are asked for

    @property
    def seed(self) -> int:
        return self.choices[0].seed


@dataclass
class KVWanted:
    """DECODE: the request now holds blocks for P's KV; the server fetches the bytes and hands
    them over (``AsyncEngine.receive_kv``). A replica without room pulls nothing."""

    request_id: str


@dataclass
class RequestOutput:
    """The tokens one choice of a request produced in one engine step (streamed to the caller)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_output_tokens: int  # so far, this engine's tokens plus P's first token in DECODE mode
    finished: bool
    finish_reason: str | None
    seed: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float | None = None
    prefill: PrefillResult | None = None  # PREFILL mode: set on the first-token outputs of the choices going to D
    # The engine's clock (time.time()): when the request arrived, was first scheduled, and made
    # its first token (DECODE mode: the first token is P's, so first_token_time = arrival_time).
    first_token_time: float | None = None
    arrival_time: float | None = None
    scheduled_time: float | None = None
    error: str | None = None  # set when the engine failed this request
    # On the last output only: every output token (P's first included) and the whole text.
    output_token_ids: list[int] | None = None
    text: str | None = None
    index: int = 0  # the choice (0 .. n - 1)
    # On each choice's first output, when asked for (SamplingParams.prompt_logprobs): one entry
    # per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # When asked for (SamplingParams.return_*_logits), float32, the model's raw logits: on each
    # choice's first output the prompt's [prompt tokens, V]; on every output its new tokens' [new, V].
    context_logits: np.ndarray | None = None
    generation_logits: np.ndarray | None = None
    # Beam search, on the one output of the request: the finished hypotheses, best first
    # (engine/decoding/beam_search.py Hypothesis); new_token_ids and text are the best one's, and
    # generation_logits, when asked for, is [beams, longest, V], shorter beams padded with zeros.
    beams: list | None = None


def output_base(**values) -> dict:
    """The fields of a ``RequestOutput`` with a plain default, or ``values``' (the fields that stay
    the same over a sequence's outputs): a dict to copy and fill for each output (``new_output``).
    A field made by a factory (``logprobs``) is not in it: each copy sets its own, never one list
    shared by all."""
    base = {f.name: f.default for f in fields(RequestOutput) if f.default is not MISSING}
    return base | values


def new_output(values: dict) -> RequestOutput:
    """The ``RequestOutput`` whose fields are ``values`` (an ``output_base`` copy, filled in; the dict
    becomes the object's). The step's per-row constructor: the dataclass's ``__init__`` matching
    ~16 keywords of 22 fields took twice as long, at every row of every step."""
    output = object.__new__(RequestOutput)
    output.__dict__ = values
    return output
