"""LLMEngine's speculative steps: the drafts a decoding sequence runs, and how many stand.

Before each step every sequence about to decode gets its drafts (``_propose_drafts``, from
engine/decoding/speculative.py's Drafter); the scheduler gives it 1 + k tokens; its k + 1 sampled rows
(``_draft_rows``) decide how many drafts stand (``_accepted_drafts``), which the scheduler's
commit counts as computed and ``LLMEngine._postprocess`` appends, one output each. A mixin of
LLMEngine: it uses the engine's config, drafter, vocabulary, ``_seqs`` and ``_sampling_row``.
"""

from __future__ import annotations

import numpy as np

from engine.execution.model_runner import StepResult
from engine.request import GenerationRequest, Sequence
from engine.scheduler import ScheduledBatch
from engine.decoding.speculative import accepted_length
from sampling import SamplingRow


class DraftSteps:
    def _validate_drafts(self, request: GenerationRequest) -> None:
        draft, limit = request.draft, self.config.max_draft_tokens
        if len(draft.token_ids) > limit:
            raise ValueError(f"draft_input_ids: {len(draft.token_ids)} draft tokens, at most {limit} here "
                             "(max_draft_tokens)")
        if request.params.beam_width > 1 or request.params.grammar is not None:
            raise ValueError("draft_input_ids: beam search and grammars run without drafts")
        if draft.logits is not None:
            if draft.logits.shape[1] != self.vocab_size:
                raise ValueError(f"draft_logits: shape {list(draft.logits.shape)}, this model needs "
                                 f"[draft tokens, {self.vocab_size}]")
            if not np.isfinite(draft.logits).all():
                raise ValueError("draft_logits: values must be finite")

    def _propose_drafts(self) -> None:
        """Each sequence about to decode gets this step's drafts (engine/decoding/speculative.py): one whose
        last token is all it has left to compute, or one that waits for P's KV and its first step."""
        for seq in self._seqs.values():
            left = seq.num_tokens - seq.num_computed_tokens
            decoding = seq.num_output_tokens > 0 and (left == 1 or seq.pending_kv is not None)
            seq.step_drafts = self.drafter.propose(seq, self._draft_room(seq)) if decoding else None

    def _draft_room(self, seq: Sequence) -> int:
        """Drafts worth verifying: the tokens ``seq`` may still produce, less the one every step makes."""
        left = min(seq.params.max_new_tokens - seq.num_output_tokens,
                   self.config.max_iter_times - self._capped_tokens(seq),
                   self.max_model_len - seq.num_tokens)
        return left - 1

    def _draft_rows(self, seq: Sequence, k: int) -> list[SamplingRow]:
        """The k + 1 rows of a step that verifies k drafts: row j samples after the drafts before
        it, as plain decoding would after those tokens; a row with the draft's probabilities
        verifies its draft by the speculative-sampling rule in the sampler."""
        drafts = seq.step_drafts
        rows = []
        for j in range(k + 1):
            row = self._sampling_row(seq, seq.seed)
            row.output_ids = seq.output_ids + drafts.token_ids[:j]
            if j < k and drafts.probs is not None:
                row.draft_token, row.draft_probs = drafts.token_ids[j], drafts.probs[j]
            rows.append(row)
        return rows

    def _accepted_drafts(self, batch: ScheduledBatch, result: StepResult, repeats: list[int]) -> list[int]:
        """Per entry, how many of its drafts stand (engine/decoding/speculative.py), counted for the metrics."""
        accepted, row = [], 0
        for (seq, _), drafted, repeat in zip(batch.entries, batch.drafted, repeats):
            count = 0
            if drafted:
                count = accepted_length(result.sampled.token_ids[row:row + drafted], seq.step_drafts.token_ids)
                self.drafter.record(drafted, count)
            accepted.append(count)
            row += repeat
        return accepted
