"""Sampled tokens in, ``RequestOutput``s out (vLLM v1's OutputProcessor is the model).

``OutputProcessor`` owns, per sequence key, the detokenizer (text, stop strings) and the grammar
matcher: it appends a sequence's tokens, decides when it ends (``finish_reason``), builds each
output, and ends PREFILL's requests by handing their choices to D with one export of the
prompt's KV (``hand_over``, ``prefill_result``). It never owns a sequence: the step loop
(engine/llm_engine.py) gives it ``release``, which frees a finished sequence's blocks and
registry entry and calls ``forget`` here. Beams end elsewhere (engine/decoding/beam_steps.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.execution.model_runner import ModelRunner, StepResult
from engine.execution.persistent_batch import PersistentBatch
from engine.kv_transfer import KVPayload
from engine.outputs import (ABORT, EOS, LENGTH, STOP, ChoiceStart, PrefillResult, RequestOutput, Sampled, TokenLogprob,
                            new_output, output_base)
from engine.request import Mode, PendingChoice, Sequence
from sampling import SamplerOutput, SamplingParams
from sampling.grammar import GrammarCompiler, GrammarDeadEnd, Matcher, MatcherState

SequenceKey = tuple[str, int]  # (request id, choice index)
UNDECIDED = object()  # append_token: no verdict from the batch's stop columns


@dataclass(eq=False)
class OutputProcessor:
    """Built with what it reads; owns the per-sequence text and grammar state."""

    tokenizer: object
    grammars: GrammarCompiler
    config: EngineConfig
    max_model_len: int
    eos_token_ids: list[int]  # the model's
    runner: ModelRunner  # PREFILL's KV export
    release: Callable[[Sequence], None]  # the loop frees an ended sequence (and calls ``forget``)
    rows: PersistentBatch  # a running sequence's columns: its appended tokens are written there
    detokenizers: dict[SequenceKey, IncrementalDetokenizer] = field(default_factory=dict, init=False)
    matchers: dict[SequenceKey, MatcherState] = field(default_factory=dict, init=False)  # made on first use
    # A sequence's output fields that no later output changes (``output_base``), once it is
    # scheduled and has its first token.
    output_bases: dict[SequenceKey, dict] = field(default_factory=dict, init=False)

    # ---- per-sequence state ---------------------------------------------------------------

    def start(self, seq: Sequence) -> None:
        """seq's text starts here (a resumed request's earlier output already counted as seen)."""
        self.detokenizers[seq.key] = self._detokenizer(seq)

    def start_from_first_token(self, seq: Sequence, choice: PendingChoice) -> None:
        """DECODE mode: the choice's first token came from P, whose text P already released."""
        self.start(seq)
        seq.token_ids.append(choice.first_token_id)
        self.rows.write_token(seq)
        seq.first_token_time = seq.arrival_time
        if choice.first_logprob is not None:
            seq.cumulative_logprob += choice.first_logprob
        self.detokenizers[seq.key].add(choice.first_token_id)

    def forget(self, seq: Sequence) -> None:
        """seq has ended: drop its text and grammar state (beams after the first have no detokenizer)."""
        self.detokenizers.pop(seq.key, None)
        self.matchers.pop(seq.key, None)
        self.output_bases.pop(seq.key, None)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        """A detokenizer that has seen seq's output so far (a resumed request's earlier tokens,
        whose text the client has): its held-back text and stop-string state go on from there."""
        p = seq.params
        detok = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens, p.include_stop_str_in_output)
        for token in seq.output_ids:
            detok.add(token)
        return detok

    def grammar_bitmask(self, seq: Sequence) -> torch.Tensor:
        """[W] int32: the tokens seq's grammar allows next."""
        return self.grammars.bitmask(self._matcher(seq))

    def _grammar_complete(self, seq: Sequence) -> bool:
        """Whether seq's grammar is complete after its output so far: nothing but EOS may follow."""
        return seq.params.grammar is not None and self._matcher(seq).is_stopped()

    def _matcher(self, seq: Sequence) -> Matcher:
        """seq's grammar matcher, advanced over its whole output. It is made on first use from the
        output so far, which covers D after P's first token and a choice after its fork."""
        entry = self.matchers.get(seq.key)
        if entry is None:
            entry = self.matchers[seq.key] = MatcherState(self.grammars.matcher(seq.params.grammar, []))
        new = seq.output_ids[entry.consumed:]
        if new and not entry.matcher.consume_tokens(new):  # the mask allowed them: only a bug gets here
            raise GrammarDeadEnd(f"grammar: the matcher refused tokens {new}: {entry.matcher.get_error()}")
        entry.consumed += len(new)
        return entry.matcher

    # ---- tokens and when they end a sequence ----------------------------------------------

    def eos_ids(self, params: SamplingParams) -> list[int]:
        """The request's end id (TensorRT-LLM's end_id), else the model's EOS ids."""
        return [params.eos_token_id] if params.eos_token_id is not None else self.eos_token_ids

    def append_token(self, seq: Sequence, sampled: Sampled, verdict: str | None | object = UNDECIDED
                     ) -> list[RequestOutput]:
        """seq's next token: its output, and seq's end if the token ends it (never a beam's).
        ``verdict``: the end the batch's stop columns decided for this token (EOS, STOP, LENGTH or
        None; engine/execution/persistent_batch.py ``stops``), which wrote the token there too;
        a stop string still ends it here. Else decided here, row by row."""
        token = sampled.token_id
        logprobs, text, stopped = self._take(seq, token, sampled.logprob)
        if verdict is UNDECIDED:
            self.rows.write_token(seq)
        try:
            complete = self._grammar_complete(seq)
        except GrammarDeadEnd as error:
            return self.finish(seq, ABORT, [token], text, logprobs, error=str(error), logits=sampled.logits)
        if verdict is UNDECIDED:
            reason = self.finish_reason(seq, token, complete or stopped)
        else:
            reason = _with_stop_string(verdict, stopped)
        if reason is not None:
            return self.finish(seq, reason, [token], text, logprobs, logits=sampled.logits)
        return [self._output(seq, [token], text, logprobs, finished=False, logits=sampled.logits)]

    def append_decoded(self, seqs: list[Sequence], sampled: SamplerOutput, verdicts: list) -> list[RequestOutput]:
        """A decode step's tokens ``sampled`` [R] for ``seqs`` [R] that sample and stop from their
        persistent-batch columns (no grammar, beam or generation logits; the tokens are in the
        columns already): ``append_token`` for each, without its per-row grammar and stop checks
        where ``verdicts`` [R] holds the columns' verdict (UNDECIDED rows take append_token)."""
        outputs = []
        detokenizers, bases = self.detokenizers, self.output_bases
        for seq, token, logprob, top, verdict in zip(seqs, sampled.token_ids, sampled.logprobs,
                                                     sampled.top_logprobs, verdicts):
            if verdict is None and logprob is None:
                key = seq.request_id, seq.index
                base = bases.get(key)
                if base is not None:  # the step's common row: past its first output, no logprobs, not ending
                    token_ids = seq.token_ids
                    token_ids.append(token)
                    text, stopped = detokenizers[key].add(token)
                    if stopped:
                        outputs += self.finish(seq, STOP, [token], text)
                        continue
                    # ``_output``'s fields, set without its checks: ``base`` holds those of a running
                    # output past its first (not finished, no prompt rows), a row without logprobs has
                    # no cumulative one, and a decode step returns no logits.
                    values = base.copy()
                    values["new_token_ids"] = [token]
                    values["new_text"] = text
                    values["num_output_tokens"] = len(token_ids) - seq.num_prompt_tokens
                    values["logprobs"] = []
                    outputs.append(new_output(values))
                    continue
            chosen = TokenLogprob(token, logprob, top) if logprob is not None else None
            if verdict is UNDECIDED:
                outputs += self.append_token(seq, Sampled(token, chosen, None))
                continue
            logprobs, text, stopped = self._take(seq, token, chosen)
            reason = _with_stop_string(verdict, stopped)
            if reason is None:
                outputs.append(self._output(seq, [token], text, logprobs, finished=False))
            else:
                outputs += self.finish(seq, reason, [token], text, logprobs)
        return outputs

    def _take(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> tuple[list[TokenLogprob], str, bool]:
        """``token`` appended to seq's tokens (not to its columns): (its logprobs for the output,
        the text it releases, whether a stop string matched)."""
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.time()
        text, stopped = self.detokenizers[seq.key].add(token)
        if logprob is None:
            return [], text, stopped
        seq.cumulative_logprob += logprob.logprob
        return [logprob], text, stopped

    def finish_reason(self, seq: Sequence, token: int, stopped: bool) -> str | None:
        """``stopped``: a stop string ended the text, or the grammar is complete."""
        p = seq.params
        if not p.ignore_eos and token in self.eos_ids(p):
            return EOS
        if stopped or (p.stop_token_ids and any(seq.output_ids[-len(s):] == s for s in p.stop_token_ids)):
            return STOP
        if seq.num_output_tokens >= p.max_new_tokens or self.capped_tokens(seq) >= self.config.max_iter_times:
            return LENGTH
        if seq.num_tokens >= self.max_model_len:
            return LENGTH
        return None

    def capped_tokens(self, seq: Sequence) -> int:
        """The output tokens of ``seq`` that the server cap (max_iter_times) counts: on D, the
        first is P's (MindIE counts P's and D's tokens)."""
        decode_side = seq.mode is Mode.DECODE or self.config.first_token_from_prefill
        return seq.num_output_tokens - (1 if decode_side and seq.num_output_tokens else 0)

    # ---- outputs ------------------------------------------------------------------------

    @staticmethod
    def keep_prompt_rows(result: StepResult) -> None:
        """The prompt logprobs and context logits a step computed, kept on their sequences for the
        first output (by position: a preempted prompt's rows come again)."""
        for scores in result.prompt_scores:
            scores.seq.prompt_logprobs[scores.first:scores.first + len(scores.entries)] = scores.entries
        for kept in result.context_logits:
            seq = kept.seq
            if seq.context_logits is None:
                seq.context_logits = torch.empty(seq.num_prompt_tokens, kept.logits.shape[1])
            seq.context_logits[kept.first:kept.first + len(kept.logits)] = kept.logits

    def finish(self, seq: Sequence, reason: str, tokens: list[int] = (), text: str = "",
               logprobs: list[TokenLogprob] = (), error: str | None = None,
               logits: np.ndarray | None = None) -> list[RequestOutput]:
        """End ``seq`` (not a beam) and its choices still to fork, which end with it; released here."""
        outputs = [self._end_unforked(seq, choice, reason, error) for choice in seq.pending_choices]
        seq.finish_reason = reason
        detok = self.detokenizers[seq.key]
        text += detok.finish()
        output = self._output(seq, list(tokens), text, list(logprobs), finished=True, logits=logits)
        output.output_token_ids = seq.output_ids
        output.text = detok.text
        output.error = error
        self.release(seq)
        return outputs + [output]

    def _end_unforked(self, seq: Sequence, choice: PendingChoice, reason: str, error: str | None) -> RequestOutput:
        """The final output of a choice that never forked (its request ended before the prompt did)."""
        tokens = [choice.first_token_id] if choice.first_token_id is not None else []
        text = self.tokenizer.decode(tokens, skip_special_tokens=seq.params.skip_special_tokens) if tokens else ""
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="",
                             num_output_tokens=len(tokens), finished=True, finish_reason=reason, seed=choice.seed,
                             first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                             scheduled_time=seq.scheduled_time, error=error,
                             output_token_ids=tokens, text=text, index=choice.index)

    def _output(self, seq: Sequence, tokens: list[int], text: str, logprobs: list[TokenLogprob],
                finished: bool, logits: np.ndarray | None = None) -> RequestOutput:
        num_output = seq.num_output_tokens
        base = self.output_bases.get(seq.key)
        if base is None:
            base = output_base(request_id=seq.request_id, seed=seq.seed, first_token_time=seq.first_token_time,
                               arrival_time=seq.arrival_time, scheduled_time=seq.scheduled_time, index=seq.index,
                               finished=False, finish_reason=None)
            if seq.first_token_time is not None and seq.scheduled_time is not None:  # set once, never changed
                self.output_bases[seq.key] = base
        values = base.copy()
        values["new_token_ids"] = tokens
        values["new_text"] = text
        values["num_output_tokens"] = num_output
        values["finished"] = finished
        values["finish_reason"] = seq.finish_reason
        values["logprobs"] = logprobs
        if seq.params.logprobs is not None:
            values["cumulative_logprob"] = seq.cumulative_logprob
        if tokens and num_output == 1:  # the first token's output
            values["prompt_logprobs"] = seq.prompt_logprobs
            values["context_logits"] = context_logits(seq)
        values["generation_logits"] = logits
        return new_output(values)

    # ---- PREFILL's hand-over to D ---------------------------------------------------------

    def hand_over(self, seq: Sequence, firsts: list[tuple[PendingChoice, Sampled]]) -> list[RequestOutput]:
        """PREFILL mode, the prompt computed: each choice reports its first token; those that it
        does not finish go to D with one export of the prompt's KV. The blocks are freed here."""
        seq.first_token_time = time.time()
        outputs, going = [], []
        for choice, (token, logprob, logits) in firsts:
            # The choice as it stands after this token (a resumed request's earlier output before
            # it), never scheduled: its detokenizer and grammar state are made here and dropped.
            probe = seq.fork(choice)
            probe.token_ids = list(seq.token_ids)
            detok = self._detokenizer(probe)
            probe.token_ids.append(token)
            text, stopped = detok.add(token)
            complete = probe.params.grammar is not None and self.grammars.matcher(probe.params.grammar,
                                                                                  probe.output_ids).is_stopped()
            reason = self.finish_reason(probe, token, complete or stopped)
            output = RequestOutput(
                request_id=seq.request_id, new_token_ids=[token], new_text=text,
                num_output_tokens=probe.num_output_tokens, finished=reason is not None, finish_reason=reason,
                seed=choice.seed, logprobs=[logprob] if logprob else [],
                cumulative_logprob=seq.cumulative_logprob + logprob.logprob if logprob else None,
                first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                scheduled_time=seq.scheduled_time, index=choice.index,
                prompt_logprobs=seq.prompt_logprobs, context_logits=context_logits(seq), generation_logits=logits)
            if output.finished:
                output.new_text += detok.finish()
                output.output_token_ids, output.text = probe.output_ids, detok.text
            else:
                going.append((output, ChoiceStart(choice.index, token, logprob, choice.seed)))
            outputs.append(output)
        if going:
            result = self.prefill_result(seq, [c for _, c in going])
            for output, _ in going:
                output.prefill = result
        self.release(seq)
        return outputs

    def prefill_result(self, seq: Sequence, choices: list[ChoiceStart], **beams) -> PrefillResult:
        """PREFILL: what D needs to go on from ``seq``'s prompt: ``choices`` and one export of its KV
        (from ``kv_export_start``); ``beams``: beam search's state and first logits."""
        start = seq.kv_export_start
        kv = KVPayload(self.runner.kv_meta(seq.num_tokens, start), self.runner.export_kv(seq, start))
        return PrefillResult(seq.request_id, choices, kv, (seq.first_token_time - seq.arrival_time) * 1000.0, **beams)


def _with_stop_string(verdict: str | None, stopped: bool) -> str | None:
    """The end of a token the stop columns gave ``verdict``, a stop string having matched or not:
    finish_reason's order, EOS first, then a stop (string or id), then a length cap."""
    return STOP if stopped and verdict != EOS else verdict


def context_logits(seq: Sequence) -> np.ndarray | None:
    """[prompt tokens, V] float32: the prompt's kept logits, when seq's request asked for them."""
    return seq.context_logits.numpy() if seq.context_logits is not None else None


def sampled_tokens(seq: Sequence, result: StepResult, rows: range) -> list[Sampled]:
    """The tokens a step sampled for ``seq`` at ``rows`` of its result, with logprobs and logits."""
    return [Sampled(result.sampled.token_ids[r], _logprob(result, r), _generation_logits(seq, result, r))
            for r in rows]


def _logprob(result: StepResult, row: int) -> TokenLogprob | None:
    sampled = result.sampled
    if sampled.logprobs[row] is None:
        return None
    return TokenLogprob(sampled.token_ids[row], sampled.logprobs[row], sampled.top_logprobs[row])


def _generation_logits(seq: Sequence, result: StepResult, row: int) -> np.ndarray | None:
    """[1, V] float32: row's raw logits, when seq's request asked for them."""
    if not seq.params.return_generation_logits:
        return None
    return result.sample_logits[row:row + 1].numpy().copy()  # not a view that keeps the step's [R, V] alive
