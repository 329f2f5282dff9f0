"""Beam search as a decoding strategy: the sequences follow what engine/decoding/beam_search.py decides.

A request with ``beam_width`` > 1 runs as a ``BeamGroup`` of sequences that share blocks;
``BeamSearch`` holds the groups, by request id. Each step every running beam reports its last
row's raw logits instead of sampling a token (``report``, from the step loop); once all have,
``advance`` asks the ``BeamState`` for the next beams: a parent chosen once appends its token,
one chosen again is cloned first (blocks shared, the partial tail copied on write by
engine/block_manager.py), one not chosen is released. P makes the first step and hands its beams
to D as choices (``_hand_over``); the search ends in one output with every hypothesis (``end``).
The step loop owns the sequences: it gives ``register`` and ``release`` for the beams this
strategy makes and ends.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.decoding.beam_search import BeamGroup, BeamState, Candidate, Hypothesis
from engine.output_processor import OutputProcessor, context_logits
from engine.outputs import EOS, LENGTH, ChoiceStart, PrefillResult, RequestOutput, TokenLogprob
from engine.request import Mode, PendingChoice, Sequence
from engine.scheduler import Scheduler


@dataclass(eq=False)
class BeamSearch:
    """Built with what it uses; owns the beam groups of the requests searching with beams."""

    scheduler: Scheduler  # clones a beam chosen twice
    register: Callable[[Sequence], None]  # the loop's sequence registry: a clone joins it
    release: Callable[[Sequence], None]  # ... and an ended beam leaves it
    output_processor: OutputProcessor  # end ids, PREFILL's KV export
    tokenizer: object
    config: EngineConfig
    max_model_len: int
    groups: dict[str, BeamGroup] = field(default_factory=dict, init=False)  # by request id
    _stepped: dict[str, BeamGroup] = field(default_factory=dict, init=False)  # groups reported to this step

    def searching(self, request_id: str) -> bool:
        return request_id in self.groups

    def start(self, seq: Sequence, prefill: PrefillResult | None) -> None:
        """A request's beams: its one sequence for now (DECODE: the best of P's beams, the others
        fork from it once its KV is in), and the search's state (DECODE: P's, after its step)."""
        p = seq.params
        logits = {} if p.return_generation_logits else None
        if prefill is not None:
            first = prefill.choices[0].first_logprob
            group = BeamGroup(copy.deepcopy(prefill.beam_state), [seq], {seq.index: [first.logprob]}, logits,
                              next_index=len(prefill.choices))
        else:
            room = self.max_model_len - seq.num_prompt_tokens
            state = BeamState(p.beam_width, p.length_penalty, p.early_stopping,
                              min(p.max_new_tokens, self.config.max_iter_times, room),
                              [] if p.ignore_eos else self.output_processor.eos_ids(p))
            group = BeamGroup(state, [seq], {seq.index: []}, logits)
        if logits is not None:
            logits[seq.index] = [prefill.beam_logits] if prefill is not None else []
        self.groups[seq.request_id] = group

    def adopt(self, parent: Sequence, child: Sequence, choice: PendingChoice) -> None:
        """DECODE: ``child``, one of P's beams, forked from ``parent`` now that the prompt's KV is in."""
        group = self.groups[parent.request_id]
        group.beams.append(child)
        group.token_logprobs[child.index] = [choice.first_logprob]
        if group.token_logits is not None:
            group.token_logits[child.index] = list(group.token_logits[parent.index])

    def report(self, seq: Sequence, logits: torch.Tensor) -> None:
        """A beam's next-token raw logits [V] this step; its group advances once all have (``advance``)."""
        group = self.groups[seq.request_id]
        group.reported[seq.index] = logits
        self._stepped[seq.request_id] = group

    def advance(self) -> list[RequestOutput]:
        """After a step: every group whose beams have all reported takes its next step."""
        stepped, self._stepped = self._stepped, {}
        return [out for group in stepped.values() if group.all_reported() for out in self._advance(group)]

    def _advance(self, group: BeamGroup) -> list[RequestOutput]:
        beams = group.beams
        rows = [group.reported.pop(b.index) for b in beams]  # raw logits [V] each
        logprobs = torch.stack(rows).float().log_softmax(-1)  # [b, V]
        history = {b.index: group.token_logprobs.pop(b.index) for b in beams}
        step = group.state.advance(logprobs, [b.cumulative_logprob for b in beams], [b.output_ids for b in beams],
                                   [history[b.index] for b in beams])
        running_on = step.running_on
        logits = None
        if group.token_logits is not None:  # each beam's rows so far, then the one of its new token
            logits = [group.token_logits.pop(b.index) + [row.numpy().copy()] for b, row in zip(beams, rows)]
            for hypothesis, beam in step.ended:
                hypothesis.logits = logits[beam]
        if beams[0].mode is Mode.PREFILL and not step.done:
            return self._hand_over(group, running_on, logits[0][-1] if logits is not None else None)
        if step.done:
            return self.end(group.beams[0].request_id)
        # A parent chosen twice or more runs on as itself once and as copies (blocks shared) after.
        taken: set[int] = set()
        plan: list[tuple[Sequence, Candidate]] = []
        for c in running_on:
            parent = beams[c.beam]
            plan.append((parent if c.beam not in taken else self._clone(group, parent), c))
            taken.add(c.beam)
        for child, c in plan:
            child.token_ids.append(c.token_id)
            self.scheduler.rows.write_token(child)
            child.cumulative_logprob = c.cum_logprob
            group.token_logprobs[child.index] = history[beams[c.beam].index] + [c.logprob]
            if logits is not None:
                group.token_logits[child.index] = list(logits[c.beam])
        for i, beam in enumerate(beams):
            if i not in taken:
                self.release(beam)
        group.beams = [child for child, _ in plan]
        return []

    def _clone(self, group: BeamGroup, parent: Sequence) -> Sequence:
        child = self.scheduler.clone(parent, group.take_index())
        self.register(child)
        return child

    def _hand_over(self, group: BeamGroup, running_on: list[Candidate], first_logits: np.ndarray | None
                   ) -> list[RequestOutput]:
        """PREFILL: P made the search's first step; its running beams go to D as choices, with the
        search's state and one export of the prompt's KV. P's output carries no token."""
        (seq,) = group.beams
        seq.first_token_time = time.time()
        choices = [ChoiceStart(i, c.token_id, TokenLogprob(c.token_id, c.logprob, []), seq.seed)
                   for i, c in enumerate(running_on)]
        result = self.output_processor.prefill_result(seq, choices, beam_state=group.state, beam_logits=first_logits)
        output = RequestOutput(
            request_id=seq.request_id, new_token_ids=[], new_text="", num_output_tokens=0, finished=False,
            finish_reason=None, seed=seq.seed, prefill=result, first_token_time=seq.first_token_time,
            arrival_time=seq.arrival_time, scheduled_time=seq.scheduled_time,
            context_logits=context_logits(seq))
        del self.groups[seq.request_id]
        self.release(seq)
        return [output]

    def end(self, request_id: str, reason: str | None = None, error: str | None = None) -> list[RequestOutput]:
        """The request's one output: the best hypotheses, best first. Ended early (``reason``:
        abort, timeout), the running beams count as they stand."""
        group = self.groups[request_id]
        state, beams = group.state, group.beams
        hypotheses = state.finished
        if reason is not None:
            penalty = state.length_penalty
            running = [Hypothesis(b.output_ids, b.cumulative_logprob / max(1, b.num_output_tokens) ** penalty,
                                  b.cumulative_logprob, group.token_logprobs.get(b.index, []),
                                  group.token_logits.get(b.index) if group.token_logits is not None else None)
                       for b in beams]
            hypotheses = sorted(hypotheses + running, key=lambda h: -h.score)[:state.width]
        first = beams[0]
        del self.groups[request_id]
        for beam in beams:
            self.release(beam)
        best = hypotheses[0] if hypotheses else Hypothesis([], 0.0, 0.0, [])
        if reason is None:
            reason = EOS if best.token_ids and best.token_ids[-1] in state.end_ids else LENGTH
        text = self.tokenizer.decode(best.token_ids, skip_special_tokens=first.params.skip_special_tokens)
        return [RequestOutput(
            request_id=first.request_id, new_token_ids=list(best.token_ids), new_text=text,
            num_output_tokens=len(best.token_ids), finished=True, finish_reason=reason, seed=first.seed,
            cumulative_logprob=best.cum_logprob, first_token_time=first.first_token_time,
            arrival_time=first.arrival_time, scheduled_time=first.scheduled_time, error=error,
            output_token_ids=list(best.token_ids), text=text, beams=hypotheses,
            context_logits=context_logits(first) if first.mode is not Mode.DECODE else None,
            generation_logits=_padded_logits(hypotheses) if group.token_logits is not None else None)]


def _padded_logits(hypotheses: list[Hypothesis]) -> np.ndarray:
    """[beams, longest, V] float32: each hypothesis's rows, zeros after its end."""
    rows = [h.logits or [] for h in hypotheses]
    vocab = next((len(r[0]) for r in rows if r), 0)
    out = np.zeros((len(rows), max(map(len, rows), default=0), vocab), dtype=np.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = np.stack(r)
    return out

