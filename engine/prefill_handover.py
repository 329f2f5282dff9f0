"""LLMEngine's end of a PREFILL request: the prompt is computed, each choice reports its first
token, and the choices that token does not finish go to D with one export of the prompt's KV.

A mixin of LLMEngine: it uses the engine's detokenizers, grammars, runner (the KV export) and
``_finish_reason`` / ``_release``.
"""

from __future__ import annotations

import time

from engine.kv_transfer import KVPayload
from engine.outputs import ChoiceStart, PrefillResult, RequestOutput, Sampled
from engine.request import PendingChoice, Sequence


class PrefillHandOver:
    def _hand_over(self, seq: Sequence, firsts: list[tuple[PendingChoice, Sampled]]) -> list[RequestOutput]:
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
            reason = self._finish_reason(probe, token, complete or stopped)
            output = RequestOutput(
                request_id=seq.request_id, new_token_ids=[token], new_text=text,
                num_output_tokens=probe.num_output_tokens, finished=reason is not None, finish_reason=reason,
                seed=choice.seed, logprobs=[logprob] if logprob else [],
                cumulative_logprob=seq.cumulative_logprob + logprob.logprob if logprob else None,
                first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                scheduled_time=seq.scheduled_time, index=choice.index,
                prompt_logprobs=seq.prompt_logprobs, context_logits=self._context_logits(seq), generation_logits=logits)
            if output.finished:
                output.new_text += detok.finish()
                output.output_token_ids, output.text = probe.output_ids, detok.text
            else:
                going.append((output, ChoiceStart(choice.index, token, logprob, choice.seed)))
            outputs.append(output)
        if going:
            result = self._prefill_result(seq, [c for _, c in going])
            for output, _ in going:
                output.prefill = result
        self._release(seq)
        return outputs

    def _prefill_result(self, seq: Sequence, choices: list[ChoiceStart], **beams) -> PrefillResult:
        """PREFILL: what D needs to go on from ``seq``'s prompt: ``choices`` and one export of its KV
        (from ``kv_export_start``); ``beams``: beam search's state and first logits."""
        start = seq.kv_export_start
        kv = KVPayload(self.runner.kv_meta(seq.num_tokens, start), self.runner.export_kv(seq, start))
        return PrefillResult(seq.request_id, choices, kv, (seq.first_token_time - seq.arrival_time) * 1000.0, **beams)
