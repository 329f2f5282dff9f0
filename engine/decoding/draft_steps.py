"""Draft verification as a decoding strategy: the drafts a decoding sequence runs, and how many stand.

Before each step every sequence about to decode gets its drafts (``propose``, from
engine/decoding/speculative.py's Drafter, which ``DraftVerification`` holds); the scheduler gives
it 1 + k tokens; its k + 1 sampled rows (``rows``) decide how many drafts stand (``accepted``),
which the scheduler's commit counts as computed and the step loop appends, one output each.
A client's drafts are checked with the rest of its request (engine/validation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.decoding.speculative import Drafter, accepted_length
from engine.execution.model_runner import StepResult
from engine.request import Sequence
from engine.scheduler import ScheduledBatch
from sampling import SamplingRow


class DraftVerification:
    def __init__(self, config: EngineConfig, max_model_len: int, sampling_row: Callable[[Sequence, int], SamplingRow],
                 capped_tokens: Callable[[Sequence], int]) -> None:
        """``sampling_row(seq, seed)``: the loop's row for seq's next token; ``capped_tokens(seq)``:
        the output tokens the server cap counts (engine/output_processor.py)."""
        self.config = config
        self.max_model_len = max_model_len
        self.sampling_row = sampling_row
        self.capped_tokens = capped_tokens
        self.drafter = Drafter(config)

    def propose(self, seqs: Iterable[Sequence]) -> None:
        """Each sequence about to decode gets this step's drafts (engine/decoding/speculative.py): one whose
        last token is all it has left to compute, or one that waits for P's KV and its first step."""
        lookup = self.config.prompt_lookup
        for seq in seqs:
            if seq.draft is None and not (lookup if seq.prompt_lookup is None else seq.prompt_lookup):
                seq.step_drafts = None  # drafts neither its own nor looked up: nothing to propose
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            decoding = seq.num_output_tokens > 0 and (left == 1 or seq.pending_kv is not None)
            seq.step_drafts = self.drafter.propose(seq, self._room(seq)) if decoding else None

    def _room(self, seq: Sequence) -> int:
        """Drafts worth verifying: the tokens ``seq`` may still produce, less the one every step makes."""
        left = min(seq.params.max_new_tokens - seq.num_output_tokens,
                   self.config.max_iter_times - self.capped_tokens(seq),
                   self.max_model_len - seq.num_tokens)
        return left - 1

    def rows(self, seq: Sequence, k: int) -> list[SamplingRow]:
        """The k + 1 rows of a step that verifies k drafts: row j samples after the drafts before
        it, as plain decoding would after those tokens; a row with the draft's probabilities
        verifies its draft by the speculative-sampling rule in the sampler."""
        drafts = seq.step_drafts
        rows = []
        for j in range(k + 1):
            row = self.sampling_row(seq, seq.seed)
            row.output_ids = seq.output_ids + drafts.token_ids[:j]
            if j < k and drafts.probs is not None:
                row.draft_token, row.draft_probs = drafts.token_ids[j], drafts.probs[j]
            rows.append(row)
        return rows

    def accepted(self, batch: ScheduledBatch, result: StepResult, repeats: list[int]) -> list[int]:
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
