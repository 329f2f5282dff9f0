"""Speculative decoding: where a step's draft tokens come from, and how many of them stand.

A decoding sequence may run a step over its last token plus k draft tokens, one forward for
k + 1 positions. Row j's next token is then sampled exactly as plain decoding would sample it
after the drafts before it (the same processors over the same history, the same keyed noise
for that output position: sampling/noise.py). The drafts stand while each equals the token
sampled before it; the first token that differs is kept instead, and after k matches the
(k+1)-th row's token is kept as well: the longest valid prefix plus one. So with drafts
given as tokens alone, greedy or seeded, the output is the output without drafts, token for
token. With ``draft_logits`` a draft row samples by the speculative-sampling rule
(sampling/speculative.py), which leaves the distribution unchanged.

Drafts come from two places, in this order:
- the request's own (TensorRT-LLM's ``draft_input_ids``, with ``draft_logits`` optionally): a
  guess of its output from the first token on, verified where the output so far agrees with it;
- prompt lookup (vLLM's n-gram proposer): the tokens that followed the most recent earlier
  occurrence of the sequence's last n tokens, n from ``prompt_lookup_max`` down to
  ``prompt_lookup_min``, in the prompt and the output so far. No second model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig


@dataclass
class StepDrafts:
    """The drafts one sequence runs this step: ids [k], and q [k, V] (the draft's probabilities)
    when they came with logits."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


NO_DRAFTS = StepDrafts([])


def prompt_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """k tokens that followed the latest earlier occurrence of the last n tokens of ``tokens`` [T]
    (the longest n in [min_n, max_n] that occurs); [] when none does. A match close to the end
    runs on into its own drafts: text that repeats with period p continues with period p."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)  # [T - n, n]: not the suffix itself
        starts = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            period = total - follow  # > 0: the match ends before the suffix does
            return [int(tokens[follow + i % period]) for i in range(k)]
    return []


def accepted_length(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts stand: draft j stands when row j sampled it."""
    count = 0
    for token, draft in zip(sampled, drafts):
        if token != draft:
            break
        count += 1
    return count


class Drafter:
    """Proposes each decoding sequence's drafts for the next step."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Since start, as vLLM counts them: steps that verified drafts, drafts verified, drafts that stood.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    def propose(self, seq, room: int) -> StepDrafts:
        """``seq``'s drafts: at most ``room`` (the tokens it may still produce, less the one every
        step produces): the request's own while its output so far agrees with them, else prompt
        lookup when the request or the app turned it on. Grammars and beams run without drafts."""
        if room <= 0 or seq.params.grammar is not None or seq.params.beam_width > 1:
            return NO_DRAFTS
        own = seq.draft
        done = seq.num_output_tokens
        if own is not None and len(own.token_ids) > done and own.token_ids[:done] == seq.output_ids:
            end = done + min(room, self.config.max_draft_tokens)
            probs = None if own.logits is None else torch.from_numpy(own.logits[done:end]).softmax(-1)  # [k, V]
            return StepDrafts(own.token_ids[done:end], probs)
        wants = seq.prompt_lookup if seq.prompt_lookup is not None else self.config.prompt_lookup
        if not wants or seq.prompt_table is not None:  # p-tuning ids stand for embeddings, not text
            return NO_DRAFTS
        return StepDrafts(prompt_lookup(np.asarray(seq.token_ids, dtype=np.int64),
                                        min(room, self.config.num_speculative_tokens),
                                        self.config.prompt_lookup_min, self.config.prompt_lookup_max))
