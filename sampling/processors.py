"""Logits processors: penalties, biases and bans, applied in place before sampling.

Each function takes logits [R, V] (float32, one row per sampling request), the batch and
the rows that ask for it, and changes those rows of the logits in place. ``PROCESSORS``
pairs each with the test of whether a request asks for it, stated once. Semantics follow
transformers' processors of the same names (tests compare against them) and OpenAI's for
presence/frequency penalties. Order, as transformers applies them: logit bias, repetition
penalty, presence/frequency penalties, no-repeat n-gram ban, bad words, minimum length (EOS
masked). Temperature is applied after all of them, by the sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # batch.py asks this module which requests use a processor
    from sampling.batch import SamplingBatch
    from sampling.params import SamplingParams


def apply_all(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Apply every processor that some row of the batch asks for (in place), in order."""
    for applies, apply in PROCESSORS:
        rows = batch.rows_where(applies)
        if rows:
            apply(logits, batch, rows)


def uses_processors(params: SamplingParams) -> bool:
    """Whether a request asks for any processor (else the sampler skips them all)."""
    return any(applies(params) for applies, _ in PROCESSORS)


def _padded(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists as ([R, L] int64 ids, [R, L] bool valid), padded with id 0."""
    width = max(1, max(len(s) for s in sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    valid = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        valid[i, : len(s)] = True
    return ids.to(device), valid.to(device)


def _counts(sequences: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts of each token id per row."""
    ids, valid = _padded(sequences, device)
    counts = torch.zeros(len(sequences), vocab, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, valid.to(torch.float32))


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """Add each row's {token id: bias} in one scatter over the whole batch."""
    biases = [(i, token, value) for i in rows for token, value in batch.rows[i].params.logit_bias.items()]
    row_ids, token_ids, values = (torch.tensor(col, device=logits.device) for col in zip(*biases))
    logits.index_put_((row_ids, token_ids), values.to(logits.dtype), accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt and output tokens."""
    index = torch.tensor(rows, device=logits.device)
    seen = _counts([batch.rows[i].prompt_ids + batch.rows[i].output_ids for i in rows],
                   logits.shape[1], logits.device) > 0  # [r, V]
    penalty = torch.tensor([batch.rows[i].params.repetition_penalty for i in rows],
                           dtype=logits.dtype, device=logits.device)[:, None]
    sub = logits[index]
    penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
    logits[index] = torch.where(seen, penalised, sub)


def apply_presence_frequency(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """OpenAI's penalties: logit -= frequency * count + presence * (count > 0), output only."""
    index = torch.tensor(rows, device=logits.device)
    counts = _counts([batch.rows[i].output_ids for i in rows], logits.shape[1], logits.device)
    presence = torch.tensor([batch.rows[i].params.presence_penalty for i in rows], device=logits.device)
    frequency = torch.tensor([batch.rows[i].params.frequency_penalty for i in rows], device=logits.device)
    logits[index] -= frequency[:, None] * counts + presence[:, None] * (counts > 0).to(counts.dtype)


def apply_no_repeat_ngram(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """transformers' NoRepeatNGramLogitsProcessor over prompt + output."""
    for i in rows:
        row = batch.rows[i]
        n = row.params.no_repeat_ngram_size
        tokens = row.prompt_ids + row.output_ids
        if len(tokens) + 1 < n:
            continue
        prefix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
        banned = {tokens[j + n - 1] for j in range(len(tokens) - n + 1) if tuple(tokens[j:j + n - 1]) == prefix}
        if banned:
            logits[i, list(banned)] = -float("inf")


def apply_bad_words(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """transformers' NoBadWordsLogitsProcessor: ban a sequence's last token when the rest
    of the sequence ends the current prompt + output (single tokens: always banned). As
    there, a sequence that is just an EOS id is ignored: bad words never forbid ending."""
    for i in rows:
        row = batch.rows[i]
        tokens = row.prompt_ids + row.output_ids
        words = [w for w in row.params.bad_words_ids if not (len(w) == 1 and w[0] in row.eos_token_ids)]
        banned = [w[-1] for w in words
                  if len(w) == 1 or (len(w) - 1 <= len(tokens) and tokens[len(tokens) - len(w) + 1:] == w[:-1])]
        if banned:
            logits[i, banned] = -float("inf")


def apply_min_new_tokens(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """Mask EOS until a row has produced min_new_tokens tokens (MinNewTokensLength...)."""
    for i in rows:
        row = batch.rows[i]
        if len(row.output_ids) < row.params.min_new_tokens and row.eos_token_ids:
            logits[i, row.eos_token_ids] = -float("inf")


# (does a request ask for it, the processor), in the order they apply.
PROCESSORS = (
    (lambda p: bool(p.logit_bias), apply_logit_bias),
    (lambda p: p.repetition_penalty != 1.0, apply_repetition_penalty),
    (lambda p: p.presence_penalty != 0.0 or p.frequency_penalty != 0.0, apply_presence_frequency),
    (lambda p: p.no_repeat_ngram_size > 0, apply_no_repeat_ngram),
    (lambda p: bool(p.bad_words_ids), apply_bad_words),
    (lambda p: p.min_new_tokens > 0, apply_min_new_tokens),
)
