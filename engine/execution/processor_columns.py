"""The persistent batch's ragged sampling controls: token histories, seen ids and the logit-bias table.

A row asking for a penalty or a ban reads its own context (prompt + output): those rows, and only
those, get a history row, ``history[h, i]`` = the sequence's ``token_ids[i]``, written in full when
it joins and one position per appended token. A row asking for a penalty also gets a counter row
(engine/execution/seen_ids.py: its distinct ids and their output counts, updated by each appended
token), which is all the penalties read at a step. A row's logit bias is kept as entries of one
sparse table (slot, token id, value), written when it joins and dropped when it leaves. A decode
step's ``ProcessorInputs`` (sampling/processors.py) are then gathers of these arrays by its slots:
the distinct ids each penalty row has seen and their penalties ([H, U]), the bias's (row, id, value)
list, with no loop over the rows (but the n-gram and bad-word bans, row by row over the rows that
ask for them, as on the per-row path).
Rows that ask for none have no entry anywhere and cost nothing.

    controls.join(slot, seq) / controls.leave(slot)
    controls.write_token(slot, num_tokens, token)             # one row (beams, forks, drafts)
    controls.append_tokens(slots, num_tokens, tokens)         # a decode step's rows
    controls.inputs(...)                                      # the step's ProcessorInputs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.execution.seen_ids import SeenIds
from sampling.processors import ListRow, ProcessorInputs, bans, uses_list_bans, uses_penalties

if TYPE_CHECKING:  # the batch's sequences, read only
    from engine.execution.persistent_batch import RowSequence

NONE = -1


class ProcessorColumns:
    """Owned by a ``PersistentBatch``, which calls it at each of its own writes (slots are its slots)."""

    def __init__(self, capacity: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.history_of = np.full(capacity, NONE, dtype=np.int64)  # [slots]: the slot's history row
        self.history = np.zeros((0, 16), dtype=np.int64)  # [history rows, width]: token ids by position
        self._free_history: list[int] = []
        self.seen_of = np.full(capacity, NONE, dtype=np.int64)  # [slots]: the slot's row in ``seen``
        self.seen = SeenIds(vocab_size)  # a penalised row's distinct ids and output counts
        # The logit-bias table: one entry per (slot, biased token id), [B] each.
        self.bias_slots = np.zeros(0, dtype=np.int64)
        self.bias_ids = np.zeros(0, dtype=np.int64)
        self.bias_values = np.zeros(0, dtype=np.float32)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the persistent batch grew)."""
        extra = capacity - len(self.history_of)
        self.history_of = np.concatenate([self.history_of, np.full(extra, NONE, dtype=np.int64)])
        self.seen_of = np.concatenate([self.seen_of, np.full(extra, NONE, dtype=np.int64)])

    @property
    def num_histories(self) -> int:
        return len(self.history) - len(self._free_history)

    @staticmethod
    def needs_history(seq: RowSequence) -> bool:
        """Whether ``seq`` reads its context: a penalty, an n-gram ban or bad words."""
        return uses_penalties(seq.params) or uses_list_bans(seq.params)

    def join(self, slot: int, seq: RowSequence) -> None:
        """``seq`` took ``slot``: its history (when it needs one) and its bias entries written."""
        if self.needs_history(seq):
            if not self._free_history:
                self._add_history_rows(max(4, len(self.history)))
            h = self._free_history.pop()
            self.history_of[slot] = h
            self._fit(len(seq.token_ids))
            self.history[h, :len(seq.token_ids)] = seq.token_ids
        if uses_penalties(seq.params):
            p = seq.params
            self.seen_of[slot] = self.seen.join(self.history[h, :len(seq.token_ids)], seq.num_prompt_tokens,
                                                p.presence_penalty, p.frequency_penalty)
        bias = seq.params.logit_bias
        if bias:
            self.bias_slots = np.concatenate([self.bias_slots, np.full(len(bias), slot, dtype=np.int64)])
            self.bias_ids = np.concatenate([self.bias_ids, np.fromiter(bias.keys(), np.int64, len(bias))])
            self.bias_values = np.concatenate([self.bias_values, np.fromiter(bias.values(), np.float32, len(bias))])

    def leave(self, slot: int) -> None:
        """``slot`` is free: its history row and bias entries go."""
        h = self.history_of[slot]
        if h != NONE:
            self._free_history.append(int(h))
            self.history_of[slot] = NONE
        r = self.seen_of[slot]
        if r != NONE:
            self.seen.leave(int(r))
            self.seen_of[slot] = NONE
        if self.bias_slots.size:
            kept = self.bias_slots != slot
            self.bias_slots, self.bias_ids, self.bias_values = (
                self.bias_slots[kept], self.bias_ids[kept], self.bias_values[kept])

    def write_token(self, slot: int, num_tokens: int, token: int) -> None:
        """A token appended to ``slot``'s sequence, now ``num_tokens`` long."""
        h = self.history_of[slot]
        if h != NONE:
            self._fit(num_tokens)
            self.history[h, num_tokens - 1] = token
            self._count(np.array([slot]), np.array([num_tokens]), np.array([token]))

    def append_tokens(self, slots: np.ndarray, num_tokens: np.ndarray, tokens: np.ndarray) -> None:
        """``tokens`` [R] appended to ``slots`` [R], their sequences now ``num_tokens`` [R] long."""
        if not self.num_histories:
            return
        history_rows = self.history_of[slots]
        kept = history_rows != NONE
        if kept.any():
            lengths = num_tokens[kept]
            self._fit(int(lengths.max()))
            self.history[history_rows[kept], lengths - 1] = tokens[kept]
            self._count(slots[kept], lengths, tokens[kept])

    def _count(self, slots: np.ndarray, num_tokens: np.ndarray, tokens: np.ndarray) -> None:
        """``seen``'s rows of ``slots`` [R] (those that have one) take their appended ``tokens`` [R]; a row
        whose token was not its next position (a rewrite) is counted afresh from its history."""
        rs = self.seen_of[slots]
        counted = rs != NONE
        if not counted.any():
            return
        rs, num_tokens = rs[counted], num_tokens[counted]
        stale = self.seen.append(rs, num_tokens, tokens[counted])
        for r, slot, n in zip(rs[stale].tolist(), slots[counted][stale].tolist(), num_tokens[stale].tolist()):
            self.seen.rebuild(r, self.history[self.history_of[slot], :n])

    def history_tokens(self, slot: int, num_tokens: int) -> list[int] | None:
        """``slot``'s history (its sequence's first ``num_tokens`` ids), None when it keeps none."""
        h = self.history_of[slot]
        return None if h == NONE else self.history[h, :num_tokens].tolist()

    def _add_history_rows(self, count: int) -> None:
        start = len(self.history)
        self.history = np.concatenate([self.history, np.zeros((count, self.history.shape[1]), dtype=np.int64)])
        self._free_history += range(start + count - 1, start - 1, -1)

    def _fit(self, length: int) -> None:
        """Histories at least ``length`` wide (doubled: a width change copies them all)."""
        width = self.history.shape[1]
        if length > width:
            wider = np.zeros((len(self.history), max(length, 2 * width)), dtype=np.int64)
            wider[:, :width] = self.history
            self.history = wider

    # ---- a step's inputs ---------------------------------------------------------------------

    def inputs(self, slots: np.ndarray, seqs: list[RowSequence | None], num_tokens: np.ndarray, num_prompt: np.ndarray,
               penalties: np.ndarray, min_new: np.ndarray, list_bans: np.ndarray) -> ProcessorInputs:
        """The processors' inputs for a step's rows ``slots`` [R] (``seqs``: the batch's sequences by
        slot), from their columns gathered by ``slots``: ``num_tokens``, ``num_prompt``, ``min_new``
        [R] int64, ``penalties`` [R, 3] float32 (repetition, presence, frequency), ``list_bans`` [R] bool."""
        bias = self._bias(slots)
        outputs = num_tokens - num_prompt
        penalised = np.flatnonzero((penalties != (1.0, 0.0, 0.0)).any(1))
        seen_ids, has_context, seen_delta = self.seen.inputs(self.seen_of[slots[penalised]])
        short = [(i, eos) for i in np.flatnonzero(outputs < min_new).tolist() for eos in seqs[slots[i]].eos_token_ids]
        list_rows = []
        for i in np.flatnonzero(list_bans).tolist():
            seq = seqs[slots[i]]
            tokens = self.history[self.history_of[slots[i]], :num_tokens[i]]
            list_rows.append(ListRow(i, tokens[tokens < self.vocab_size].tolist(), seq.params.no_repeat_ngram_size,
                                     bans(seq.params, seq.eos_token_ids)))
        values = torch.from_numpy(penalties[penalised])
        return ProcessorInputs(
            *bias, torch.from_numpy(penalised), values[:, 0], values[:, 1], values[:, 2],
            torch.from_numpy(seen_ids), torch.from_numpy(has_context), torch.from_numpy(seen_delta),
            torch.tensor([i for i, _ in short], dtype=torch.int64),
            torch.tensor([e for _, e in short], dtype=torch.int64),
            list_rows)

    def _bias(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [B] int64, token ids [B] int64, values [B] float32): the bias entries of ``slots``' rows."""
        row_of = np.full(len(self.history_of), NONE, dtype=np.int64)
        row_of[slots] = np.arange(len(slots))
        rows = row_of[self.bias_slots]
        kept = rows != NONE
        return (torch.from_numpy(rows[kept]), torch.from_numpy(self.bias_ids[kept]),
                torch.from_numpy(self.bias_values[kept]))
