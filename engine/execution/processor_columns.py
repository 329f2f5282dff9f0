"""The persistent batch's ragged sampling controls: token histories and the logit-bias table.

A row asking for a penalty or a ban reads its own context (prompt + output): those rows, and only
those, get a history row, ``history[h, i]`` = the sequence's ``token_ids[i]``, written in full when
it joins and one position per appended token. A row's logit bias is kept as entries of one sparse
table (slot, token id, value), written when it joins and dropped when it leaves. A decode step's
``ProcessorInputs`` (sampling/processors.py) are then gathers of these arrays by its slots: the ids
each penalty row has seen ([H, L]), the bias's (row, id, value) list, with no loop over the rows (but
the n-gram and bad-word bans, row by row over the rows that ask for them, as on the per-row path).
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
        # The logit-bias table: one entry per (slot, biased token id), [B] each.
        self.bias_slots = np.zeros(0, dtype=np.int64)
        self.bias_ids = np.zeros(0, dtype=np.int64)
        self.bias_values = np.zeros(0, dtype=np.float32)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the persistent batch grew)."""
        extra = capacity - len(self.history_of)
        self.history_of = np.concatenate([self.history_of, np.full(extra, NONE, dtype=np.int64)])

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
        context_ids, has_context, output_ids, in_output = self._seen_ids(
            self.history_of[slots[penalised]], num_tokens[penalised], num_prompt[penalised])
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
            torch.from_numpy(context_ids), torch.from_numpy(has_context), torch.from_numpy(output_ids),
            torch.from_numpy(in_output),
            torch.tensor([i for i, _ in short], dtype=torch.int64),
            torch.tensor([e for _, e in short], dtype=torch.int64),
            list_rows)

    def _seen_ids(self, history_rows: np.ndarray, lengths: np.ndarray, num_prompt: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For the rows of ``history_rows`` [H] (their sequences ``lengths`` [H] long, ``num_prompt`` [H]
        of them the prompt's): ``ProcessorInputs``' context_ids [H, L], has_context [H], output_ids
        [H, Lo] and in_output [H, Lo], each row's ids padded with its first one (as ``padded_ids``)."""
        width = max(1, int(lengths.max()) if len(lengths) else 1)
        history = self.history[history_rows, :width]  # [H, L]
        in_context = (np.arange(width) < lengths[:, None]) & (history < self.vocab_size)  # the prompt's real tokens
        has_context = in_context.any(1)
        first = np.where(has_context, history[np.arange(len(history)), in_context.argmax(1)], 0)
        context_ids = np.where(in_context, history, first[:, None])
        outputs = lengths - num_prompt
        out_width = max(1, int(outputs.max()) if len(outputs) else 1)
        positions = np.minimum(num_prompt[:, None] + np.arange(out_width), history.shape[1] - 1)
        output_history = np.take_along_axis(history, positions, 1)  # [H, Lo]
        in_output = np.arange(out_width) < outputs[:, None]
        first = np.where(outputs > 0, output_history[:, 0], 0)
        return context_ids, has_context, np.where(in_output, output_history, first[:, None]), in_output

    def _bias(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows [B] int64, token ids [B] int64, values [B] float32): the bias entries of ``slots``' rows."""
        row_of = np.full(len(self.history_of), NONE, dtype=np.int64)
        row_of[slots] = np.arange(len(slots))
        rows = row_of[self.bias_slots]
        kept = rows != NONE
        return (torch.from_numpy(rows[kept]), torch.from_numpy(self.bias_ids[kept]),
                torch.from_numpy(self.bias_values[kept]))
