"""The running rows' state in arrays, indexed by a row slot (vLLM v1's persistent batch).

A sequence takes a slot when it joins the running batch and gives it back when it leaves
(finish, abort, preemption). Its columns are written at those moments and when its state
changes (a token appended, tokens computed, a block added or copied on write), never rebuilt
from the sequence objects at a step: a decode step's inputs (ids, positions, slots, block
tables), its sampling columns and its stop checks are gathers of these arrays by the step's slots.

    rows.join(seq)                         # the scheduler: admitted, forked, cloned, KV arrived
    rows.write_blocks(seq)                 # the scheduler: after allocate (new block, CoW tail)
    rows.write_computed(seq)               # the scheduler's commit
    rows.write_token(seq)                  # a token appended (output processor, beams)
    rows.leave(seq)                        # finished, aborted, preempted

A row's penalties, logit bias and bans are columns too: their values here, the token histories and
the bias table in ``controls`` (engine/execution/processor_columns.py), so a decode step that mixes
rows with and without them still samples from the columns, one vectorized path.

``row_columns(seq)`` is the same state computed from the sequence alone: ``join`` writes it, and
tests compare the arrays with it after every change (tests/test_persistent_batch.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.execution.processor_columns import ProcessorColumns
from engine.execution.step_inputs import StepSequence
from sampling.batch import SamplingColumns
from sampling.noise import split_seed
from sampling.processors import uses_list_bans, uses_processors

NO_ROW = -1
EOS_WIDTH = 4  # end ids per row (the model's, or the request's one); more: the row checks them per row
STOP_WIDTH = 4  # single-token stop ids per row; more, or a longer stop sequence: checked per row


class RowSequence(StepSequence, Protocol):
    """A running sequence as the persistent batch reads it; ``row`` is the one field it writes."""

    row: int  # its slot, NO_ROW while it is not in the running batch
    seed: int
    eos_token_ids: list[int]  # the request's end id, else the model's
    decode_side: bool  # the server cap (max_iter_times) does not count its first output token


# name -> (dtype, per-row shape): every column but the block tables.
COLUMNS = {
    "token": (np.int64, ()),  # the last token: a decode step's input
    "num_tokens": (np.int64, ()),
    "num_computed": (np.int64, ()),
    "num_prompt": (np.int64, ()),
    "table_len": (np.int64, ()),
    "temperature": (np.float32, ()),  # 1.0 on greedy rows
    "top_k": (np.int64, ()),  # 0 = off
    "top_p": (np.float32, ()),
    "min_p": (np.float32, ()),
    "seed_lo": (np.int64, ()),
    "seed_hi": (np.int64, ()),
    "greedy": (np.bool_, ()),
    "logprobs": (np.int64, ()),  # top-N asked for, -1 = none
    # The processors' controls (sampling/processors.py): the dense ones; the ragged ones in ``controls``.
    "processed": (np.bool_, ()),  # asks for any processor
    "penalties": (np.float32, (3,)),  # repetition (1.0 = off), presence, frequency (0.0 = off)
    "min_new": (np.int64, ()),
    "list_bans": (np.bool_, ()),  # a no-repeat n-gram size or bad words: banned row by row
    # Samples from these columns alone: no grammar, beams, generation logits (a step with drafts
    # takes the per-row path whatever the rows).
    "plain": (np.bool_, ()),
    "max_new": (np.int64, ()),
    "ignore_eos": (np.bool_, ()),
    "eos": (np.int64, (EOS_WIDTH,)),  # -1 padded
    "stop_ids": (np.int64, (STOP_WIDTH,)),  # single-token stop ids, -1 padded
    "stops_per_row": (np.bool_, ()),  # stop ids the columns do not hold: checked per row
    "decode_side": (np.bool_, ()),
    "lora": (np.int64, ()),  # the adapter's index in ``adapters``, -1 = none
}


def _padded(ids: list[int], width: int) -> tuple[list[int], bool]:
    """``ids`` padded with -1 to ``width``, and whether they did not fit."""
    return (list(ids) + [-1] * width)[:width], len(ids) > width


class PersistentBatch:
    def __init__(self, capacity: int, table_width: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.capacity = 0
        self.table_width = table_width
        self.tables = np.zeros((0, table_width), dtype=np.int32)  # [slots, width], 0 past each table's end
        for name, (dtype, shape) in COLUMNS.items():
            setattr(self, name, np.zeros((0, *shape), dtype=dtype))
        self.seqs: list[RowSequence | None] = []  # by slot
        self._free: list[int] = []
        self.adapters: dict[tuple, int] = {}  # an adapter's (name, digest) -> its index in the lora column
        self.controls = ProcessorColumns(0, vocab_size)  # token histories and logit biases, by slot
        self._grow(max(1, capacity))

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the arrays reallocated: only when more rows run than ever before)."""
        extra = capacity - self.capacity
        self.tables = np.concatenate([self.tables, np.zeros((extra, self.table_width), dtype=np.int32)])
        for name, (dtype, shape) in COLUMNS.items():
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros((extra, *shape), dtype=dtype)]))
        self.seqs += [None] * extra
        self.controls.grow(capacity)
        self._free += range(capacity - 1, self.capacity - 1, -1)  # lowest slot taken first
        self.capacity = capacity

    @property
    def num_running(self) -> int:
        """Slots taken (no ``__len__``: an empty batch is still a batch, never falsy)."""
        return self.capacity - len(self._free)

    # ---- writes ----------------------------------------------------------------------------

    def join(self, seq: RowSequence) -> None:
        """``seq`` enters the running batch: it takes a slot and its columns are written."""
        if seq.row != NO_ROW:
            raise RuntimeError(f"persistent batch: {seq.request_id!r} joined twice")
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        seq.row = slot
        self.seqs[slot] = seq
        for name, value in self.row_columns(seq).items():
            getattr(self, name)[slot] = value
        self.controls.join(slot, seq)
        self.write_blocks(seq)

    def leave(self, seq: RowSequence) -> None:
        """``seq`` leaves the running batch (finished, aborted, preempted): its slot is free."""
        if seq.row == NO_ROW:
            return
        self.seqs[seq.row] = None
        self.tables[seq.row] = 0
        self.controls.leave(seq.row)
        self._free.append(seq.row)
        seq.row = NO_ROW

    def write_blocks(self, seq: RowSequence) -> None:
        """``seq``'s block table changed (blocks added, a shared tail copied on write)."""
        if seq.row == NO_ROW:
            return
        n = len(seq.block_table)
        if n > self.table_width:  # a sequence past max_model_len: only a bug gets here
            raise RuntimeError(f"persistent batch: {n} blocks, the table holds {self.table_width}")
        table = self.tables[seq.row]
        table[:n] = seq.block_table
        table[n:self.table_len[seq.row]] = 0
        self.table_len[seq.row] = n

    def write_grown(self, slots: np.ndarray, index: np.ndarray, seqs: list[RowSequence]) -> None:
        """``write_blocks`` for rows ``slots`` [G] (``seqs``) that each changed one entry of their block
        table, ``index`` [G] (a block appended, or a shared tail copied on write): one write for them all."""
        self.tables[slots, index] = [seq.block_table[i] for seq, i in zip(seqs, index.tolist())]
        self.table_len[slots] = [len(seq.block_table) for seq in seqs]

    def write_token(self, seq: RowSequence) -> None:
        """A token was appended to ``seq`` (one path per row: beams, forks, drafts)."""
        if seq.row != NO_ROW:
            self.token[seq.row] = seq.token_ids[-1]
            self.num_tokens[seq.row] = len(seq.token_ids)
            self.controls.write_token(seq.row, len(seq.token_ids), seq.token_ids[-1])

    def append_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """One token appended to each row of ``slots`` [R] (a decode step's sampled ``tokens`` [R])."""
        self.token[slots] = tokens
        self.num_tokens[slots] += 1
        self.controls.append_tokens(slots, self.num_tokens[slots], tokens)

    def write_computed(self, seq: RowSequence) -> None:
        if seq.row != NO_ROW:
            self.num_computed[seq.row] = seq.num_computed_tokens

    # ---- a step's views --------------------------------------------------------------------

    def decode_inputs(self, slots: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids, positions, KV slots [R] of a decode step's rows: each row's last token at its
        computed length."""
        positions = self.num_computed[slots]
        blocks = self.tables[slots, positions // block_size].astype(np.int64)
        return self.token[slots], positions, blocks * block_size + positions % block_size

    def sampling_columns(self, slots: np.ndarray) -> SamplingColumns:
        """The sampling controls of ``slots`` [R], for ``SamplingBatch.from_columns``."""
        num_tokens, num_prompt = self.num_tokens[slots], self.num_prompt[slots]
        processors = None
        if self.processed[slots].any():
            processors = self.controls.inputs(slots, self.seqs, num_tokens, num_prompt, self.penalties[slots],
                                              self.min_new[slots], self.list_bans[slots])
        return SamplingColumns(self.greedy[slots], self.temperature[slots], self.top_k[slots], self.top_p[slots],
                               self.min_p[slots], self.seed_lo[slots], self.seed_hi[slots], num_tokens - num_prompt,
                               self.logprobs[slots], processors)

    def stops(self, slots: np.ndarray, tokens: np.ndarray, max_model_len: int, max_iter_times: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """After ``tokens`` [R] were appended to ``slots`` [R]: (EOS, a stop id, a length cap) [R] bool,
        decided for the whole batch (stop strings and the rows of ``stops_per_row`` are the caller's)."""
        eos = (self.eos[slots] == tokens[:, None]).any(1) & ~self.ignore_eos[slots]
        stop = (self.stop_ids[slots] == tokens[:, None]).any(1)
        outputs = self.num_tokens[slots] - self.num_prompt[slots]
        capped = outputs - (self.decode_side[slots] & (outputs > 0))
        length = (outputs >= self.max_new[slots]) | (capped >= max_iter_times) | (self.num_tokens[slots] >= max_model_len)
        return eos, stop, length

    # ---- the state from scratch ------------------------------------------------------------

    def row_columns(self, seq: RowSequence) -> dict[str, object]:
        """Every column's value for ``seq`` computed from the sequence alone (the block tables aside)."""
        p = seq.params
        greedy = p.greedy
        lo, hi = split_seed(seq.seed)
        eos, eos_overflow = _padded(seq.eos_token_ids, EOS_WIDTH)
        singles = [s[0] for s in p.stop_token_ids if len(s) == 1]
        stop_ids, stop_overflow = _padded(singles, STOP_WIDTH)
        lora = -1
        if seq.lora is not None:
            lora = self.adapters.setdefault((seq.lora.ref.name, seq.lora.ref.digest), len(self.adapters))
        plain = not (p.grammar is not None or p.beam_width > 1 or p.return_generation_logits)
        return {
            "token": seq.token_ids[-1], "num_tokens": len(seq.token_ids), "num_computed": seq.num_computed_tokens,
            "num_prompt": seq.num_prompt_tokens, "temperature": 1.0 if greedy else p.temperature,
            "top_k": p.top_k if p.top_k < self.vocab_size else 0, "top_p": p.top_p, "min_p": p.min_p,
            "seed_lo": lo, "seed_hi": hi, "greedy": greedy, "logprobs": -1 if p.logprobs is None else p.logprobs,
            "plain": plain, "max_new": p.max_new_tokens, "ignore_eos": p.ignore_eos, "eos": eos,
            "stop_ids": stop_ids, "stops_per_row": stop_overflow or eos_overflow or len(singles) < len(p.stop_token_ids),
            "decode_side": seq.decode_side, "lora": lora, "processed": uses_processors(p),
            "penalties": (p.repetition_penalty, p.presence_penalty, p.frequency_penalty),
            "min_new": p.min_new_tokens, "list_bans": uses_list_bans(p),
        }
