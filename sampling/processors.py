"""Logits processors: penalties, biases and bans, applied in place before sampling.

They read ``ProcessorInputs``: for one step's rows [R], tensors over the rows that ask for each
control (a row that asks for none appears nowhere and costs nothing). The inputs are built either
from the step's ``SamplingRow``s (``from_rows``: a step on the per-row path) or from the persistent
batch's columns (engine/execution/processor_columns.py: a decode step from the columns); both give
the same tensors, so a row's logits are the same on either path. Semantics follow transformers'
processors of the same names (tests compare against them) and OpenAI's for presence/frequency
penalties. Order, as transformers applies them: logit bias, repetition penalty, presence/frequency
penalties, no-repeat n-gram ban, bad words, minimum length (EOS masked). Temperature is applied
after all of them, by the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the rows and params are only read
    from sampling.batch import SamplingRow
    from sampling.params import SamplingParams


@dataclass
class ListRow:
    """A row whose ban reads its own token list, row by row (no-repeat n-grams, bad words)."""

    row: int  # in the step's rows
    tokens: list[int]  # prompt (real tokens: no prompt-table ids) + output
    ngram_size: int  # 0 = off
    bad_words: list[list[int]]  # those that may ban (a lone EOS id never does)


@dataclass
class ProcessorInputs:
    """What the processors read for one step's rows [R]. Each control's rows are those that ask for it."""

    bias_rows: torch.Tensor  # [B] int64: one entry per (row, biased token id)
    bias_ids: torch.Tensor  # [B] int64
    bias_values: torch.Tensor  # [B] float32
    penalty_rows: torch.Tensor  # [H] int64: rows with a repetition, presence or frequency penalty
    repetition: torch.Tensor  # [H] float32, 1.0 = off (exactly the identity)
    presence: torch.Tensor  # [H] float32, 0.0 = off
    frequency: torch.Tensor  # [H] float32, 0.0 = off
    # The penalties work on the ids a row has seen, not on all V logits: each row's distinct ids padded
    # with its first one and that one's delta (a pad writes what its id's entry writes), so a scatter is exact.
    seen_ids: torch.Tensor  # [H, U] int64: the distinct real prompt tokens and output tokens
    has_context: torch.Tensor  # [H] bool: some id in seen_ids (else they are all pads, written unchanged)
    # [H, U] float32: frequency * count + presence * (count > 0), count = the id's occurrences in the output
    seen_delta: torch.Tensor
    min_new_rows: torch.Tensor  # [M] int64: one entry per (row short of min_new_tokens, its end id)
    min_new_ids: torch.Tensor  # [M] int64
    list_rows: list[ListRow]

    @classmethod
    def from_rows(cls, rows: list[SamplingRow]) -> "ProcessorInputs | None":
        """The inputs of a step's ``SamplingRow``s (on the CPU); None when no row asks for any control."""
        if not any(uses_processors(row.params) for row in rows):
            return None
        bias = [(i, token, value) for i, row in enumerate(rows) for token, value in row.params.logit_bias.items()]
        penalised = [i for i, row in enumerate(rows) if uses_penalties(row.params)]
        seen = [_seen(rows[i].prompt_ids, rows[i].output_ids) or {0: 0} for i in penalised]
        width = max([1] + [len(counts) for counts in seen])
        padded = [list(counts.items()) + [next(iter(counts.items()))] * (width - len(counts)) for counts in seen]
        pairs = torch.tensor(padded, dtype=torch.int64).reshape(len(seen), width, 2)
        has_context = torch.tensor([bool(rows[i].prompt_ids or rows[i].output_ids) for i in penalised],
                                   dtype=torch.bool)
        short = [(i, eos) for i, row in enumerate(rows) if len(row.output_ids) < row.params.min_new_tokens
                 for eos in row.eos_token_ids]
        list_rows = [ListRow(i, row.prompt_ids + row.output_ids, row.params.no_repeat_ngram_size,
                             bans(row.params, row.eos_token_ids))
                     for i, row in enumerate(rows) if uses_list_bans(row.params)]
        params = [rows[i].params for i in penalised]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        return cls(
            *_columns(bias, 3, (torch.int64, torch.int64, torch.float32)),
            torch.tensor(penalised, dtype=torch.int64),
            torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32), presence, frequency,
            pairs[..., 0], has_context, penalty_delta(pairs[..., 1].float(), presence, frequency),
            *_columns(short, 2, (torch.int64, torch.int64)),
            list_rows,
        )

    def to(self, device: torch.device) -> "ProcessorInputs":
        """The same inputs with their tensors on ``device`` (themselves on the CPU)."""
        if device.type == "cpu":
            return self
        return ProcessorInputs(**{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})


def _seen(prompt: list[int], output: list[int]) -> dict[int, int]:
    """Each distinct id of ``prompt`` + ``output``, in order of first appearance -> its count in ``output``."""
    counts = dict.fromkeys(prompt, 0)
    for token in output:
        counts[token] = counts.get(token, 0) + 1
    return counts


def penalty_delta(counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """[H, U] float32: ``frequency * counts + presence * (counts > 0)`` of each row's ``counts`` [H, U] and
    penalties [H] (engine/execution/seen_ids.py keeps the same per appended token, in the same operations)."""
    return frequency[:, None] * counts + presence[:, None] * (counts > 0).to(counts.dtype)


def _columns(entries: list[tuple], width: int, dtypes: tuple) -> list[torch.Tensor]:
    """``entries`` of ``width`` values as ``width`` [N] tensors of ``dtypes``."""
    columns = list(zip(*entries)) if entries else [()] * width
    return [torch.tensor(column, dtype=dtype) for column, dtype in zip(columns, dtypes)]


def _moved(value, device: torch.device):
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def uses_penalties(params: SamplingParams) -> bool:
    """Whether a request asks for a repetition, presence or frequency penalty (its context's counts)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def uses_list_bans(params: SamplingParams) -> bool:
    """Whether a request asks for a ban read from its own token list (n-grams, bad words)."""
    return params.no_repeat_ngram_size > 0 or bool(params.bad_words_ids)


def uses_processors(params: SamplingParams) -> bool:
    """Whether a request asks for any processor (else the sampler skips them all)."""
    return bool(params.logit_bias) or uses_penalties(params) or uses_list_bans(params) or params.min_new_tokens > 0


def bans(params: SamplingParams, eos_token_ids: list[int]) -> list[list[int]]:
    """The bad words that may ban a token: as transformers', a word that is just an EOS id never forbids ending."""
    return [w for w in params.bad_words_ids if not (len(w) == 1 and w[0] in eos_token_ids)]


def apply_all(logits: torch.Tensor, inputs: ProcessorInputs) -> None:
    """Apply every control of ``inputs`` to ``logits`` [R, V] (in place), in order."""
    if inputs.bias_rows.numel():  # one scatter: each (row, id) at most once
        logits.index_put_((inputs.bias_rows, inputs.bias_ids), inputs.bias_values.to(logits.dtype), accumulate=True)
    if inputs.penalty_rows.numel():
        apply_penalties(logits, inputs)
    for row in inputs.list_rows:
        if row.ngram_size:
            apply_no_repeat_ngram(logits, row.row, row.tokens, row.ngram_size)
        if row.bad_words:
            apply_bad_words(logits, row.row, row.tokens, row.bad_words)
    if inputs.min_new_rows.numel():  # MinNewTokensLength...: EOS masked until min_new_tokens are out
        logits[inputs.min_new_rows, inputs.min_new_ids] = -float("inf")


def apply_penalties(logits: torch.Tensor, inputs: ProcessorInputs) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt and output, then OpenAI's
    logit -= frequency * count + presence * (count > 0) over the output: on the logits of the
    distinct ids each row has seen ([H, U] gathers and one scatter), never on all V (a select
    over [H, V] cost ~100 µs at V = 1,024 on the 2-core box). An id of the prompt alone has count
    0: x - 0 is x. A row's off penalty (1.0; 0.0) changes none of its logits: x * 1, x / 1 and
    x - 0 are x."""
    index = inputs.penalty_rows
    sub = logits[index]  # [H, V]
    ids = inputs.seen_ids
    values = sub.gather(1, ids)
    penalty = inputs.repetition.to(logits.dtype)[:, None]
    penalised = torch.where(values < 0, values * penalty, values / penalty)
    penalised = torch.where(inputs.has_context[:, None], penalised, values)
    sub.scatter_(1, ids, penalised - inputs.seen_delta.to(logits.dtype))
    logits[index] = sub


def apply_no_repeat_ngram(logits: torch.Tensor, row: int, tokens: list[int], n: int) -> None:
    """transformers' NoRepeatNGramLogitsProcessor over ``tokens`` (prompt + output) of ``row``."""
    if len(tokens) + 1 < n:
        return
    prefix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
    banned = {tokens[j + n - 1] for j in range(len(tokens) - n + 1) if tuple(tokens[j:j + n - 1]) == prefix}
    if banned:
        logits[row, list(banned)] = -float("inf")


def apply_bad_words(logits: torch.Tensor, row: int, tokens: list[int], words: list[list[int]]) -> None:
    """transformers' NoBadWordsLogitsProcessor: ban a sequence's last token when the rest of the
    sequence ends ``tokens`` (prompt + output; single tokens: always banned)."""
    banned = [w[-1] for w in words
              if len(w) == 1 or (len(w) - 1 <= len(tokens) and tokens[len(tokens) - len(w) + 1:] == w[:-1])]
    if banned:
        logits[row, banned] = -float("inf")
