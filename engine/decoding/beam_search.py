"""Beam search's decisions, as transformers' ``generate(num_beams=k)`` makes them (its vectorised
form of 2025, ``GenerationMixin._beam_search``); the engine (llm_engine.py) owns the sequences.

Each step every running beam gives its next-token log-probabilities (log_softmax of the raw
logits, float32). ``BeamState.advance`` then does what transformers does:

- every beam's log-probs plus its running score, flattened; the best ``2k`` candidates (k = width);
- a candidate *hits* when its token is an end id or it reaches ``max_new_tokens``; the best k that
  do not hit run on; those among the best k that hit become finished hypotheses, scored
  ``cum_logprob / output_length ** length_penalty``, and the best k hypotheses are kept;
- it stops when every one of the 2k candidates hits; when ``early_stopping`` is True and k
  hypotheses are finished; or when no running beam can beat the worst hypothesis any more,
  judged by transformers' heuristic: the best running score divided by the current output
  length ``** length_penalty`` (``early_stopping="never"`` with a positive penalty divides by
  ``max_new_tokens`` instead, the best a longer beam could do).

Running beams whose every continuation hit are dropped rather than kept with a score of -1e9 as
transformers keeps them: they could never give a candidate, so the results are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from engine.request import Sequence

EarlyStopping = bool | Literal["never"]


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (an end id included when it ended with one)."""

    token_ids: list[int]
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    cum_logprob: float
    logprobs: list[float]  # each token's
    logits: list | None = None  # each token's raw logits [V] (numpy), when the request asked for them


@dataclass
class Candidate:
    """A running beam's continuation chosen to run on."""

    beam: int  # index of the parent among the running beams given to ``advance``
    token_id: int
    logprob: float
    cum_logprob: float


@dataclass
class Step:
    """What one step decided: the beams that run on (best first), the hypotheses that ended in
    it with the running beam each came from, and whether the search is over."""

    running_on: list[Candidate]
    ended: list[tuple[Hypothesis, int]]
    done: bool


@dataclass
class BeamState:
    """The decisions' state for one request (plain data: it travels from P to D)."""

    width: int
    length_penalty: float
    early_stopping: EarlyStopping
    max_new_tokens: int  # the request's, capped by the server
    end_ids: list[int]  # empty with ignore_eos
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most ``width``
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied (never comes back)

    def advance(self, logprobs: torch.Tensor, running: list[float], outputs: list[list[int]],
                output_logprobs: list[list[float]]) -> Step:
        """One step. ``logprobs`` [b, V] float32 of the b running beams, ``running`` their scores,
        ``outputs`` their output tokens so far (all of one length) and each token's logprob."""
        k, vocab = self.width, logprobs.shape[1]
        length = len(outputs[0]) + 1  # the output length with the new token
        scores = (logprobs + torch.tensor(running, dtype=torch.float32)[:, None]).reshape(-1)  # [b * V]
        top_scores, top_ids = torch.topk(scores, min(2 * k, scores.numel()))
        candidates = [Candidate(int(i) // vocab, int(i) % vocab, float(logprobs.view(-1)[i]), float(s))
                      for s, i in zip(top_scores, top_ids)]
        hits = [c.token_id in self.end_ids or length >= self.max_new_tokens for c in candidates]
        running_on = [c for c, hit in zip(candidates, hits) if not hit][:k]
        full = len(self.finished) == k
        ended = []
        if self.improvable and not (full and self.early_stopping is True):
            ended = [(Hypothesis(outputs[c.beam] + [c.token_id], c.cum_logprob / length ** self.length_penalty,
                                 c.cum_logprob, output_logprobs[c.beam] + [c.logprob]), c.beam)
                     for c, hit in zip(candidates[:k], hits[:k]) if hit]
            self.finished = sorted(self.finished + [h for h, _ in ended], key=lambda h: -h.score)[:k]
        if running_on and len(self.finished) == k:
            best = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
            possible = running_on[0].cum_logprob / best ** self.length_penalty
            self.improvable = self.improvable and possible > self.finished[-1].score
        done = (not self.improvable or (len(self.finished) == k and self.early_stopping is True)
                or all(hits))
        return Step(running_on, ended, done)


@dataclass
class BeamGroup:
    """The engine's side of one request's beam search: its running beams (sequences sharing
    blocks, best first), what each has reported this step, and each one's token logprobs."""

    state: BeamState
    beams: list[Sequence]
    token_logprobs: dict[int, list[float]]  # by beam (sequence index)
    token_logits: dict[int, list] | None = None  # by beam: each token's raw logits [V], when asked for
    reported: dict[int, torch.Tensor] = field(default_factory=dict)  # by beam: raw logits [V] this step
    next_index: int = 1  # sequence indices are unique over the request's life

    def all_reported(self) -> bool:
        return all(beam.index in self.reported for beam in self.beams)

    def take_index(self) -> int:
        self.next_index += 1
        return self.next_index - 1
