"""The ids each penalised row has seen, kept as it goes: what the repetition, presence and frequency
penalties read at a step, updated by each appended token instead of re-read from the whole context.

A row that asks for a penalty gets a counter row ``r`` when it joins: ``ids[r, :num_seen[r]]`` are the
distinct real ids of its context (prompt tokens below the vocabulary, and outputs), in no particular
order, and ``count[r, id]`` is how often ``id`` occurs in its output (``UNSEEN`` where it is not in the
context at all: 4 bytes per id up to the largest seen, at most V, per penalised row). An appended
token costs one lookup and at most three writes; a step's inputs are a gather of ``[H, U]`` (U: the
most distinct ids of a step's rows), never of the contexts ``[H, L]``.

    r = seen.join(tokens, num_prompt)           # the row's context, once (join, resume, fork, clone)
    stale = seen.append(rs, lengths, tokens)    # one token each for rows ``rs`` (distinct)
    seen.rebuild(r, tokens)                     # a stale row: its token was not its next position
    seen.inputs(rs)                             # ProcessorInputs' seen_ids, has_context, seen_counts
    seen.leave(r)
"""

from __future__ import annotations

import numpy as np

UNSEEN = -1


class SeenIds:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # [rows, W]: an id's output count, UNSEEN where it is not in the context; W grows to the largest id
        # seen (at most V): the scheduler's own batch has no vocabulary (V = 2**62).
        self.count = np.zeros((0, 1), dtype=np.int32)
        self.ids = np.zeros((0, 16), dtype=np.int64)  # [rows, width]: the distinct ids seen, num_seen of them
        self.num_seen = np.zeros(0, dtype=np.int64)  # [rows]
        self.length = np.zeros(0, dtype=np.int64)  # [rows]: the sequence's tokens folded in
        self.num_prompt = np.zeros(0, dtype=np.int64)  # [rows]: positions below it are the prompt's (not counted)
        self._free: list[int] = []

    def join(self, tokens: np.ndarray, num_prompt: int) -> int:
        """A counter row for a sequence of ``tokens`` [L] (its first ``num_prompt`` the prompt's)."""
        if not self._free:
            self._add_rows(max(4, len(self.num_seen)))
        r = self._free.pop()
        self.num_prompt[r] = num_prompt
        self.rebuild(r, tokens)
        return r

    def leave(self, r: int) -> None:
        self._clear(r)
        self._free.append(r)

    def rebuild(self, r: int, tokens: np.ndarray) -> None:
        """Row ``r`` counted afresh from its sequence's ``tokens`` [L] (all of them)."""
        self._clear(r)
        real = tokens[tokens < self.vocab_size]
        distinct = np.unique(real)
        self._fit(len(distinct))
        self._fit_ids(distinct)
        self.ids[r, :len(distinct)] = distinct
        self.num_seen[r] = len(distinct)
        self.count[r, distinct] = 0
        outputs = tokens[self.num_prompt[r]:]
        np.add.at(self.count[r], outputs[outputs < self.vocab_size], 1)
        self.length[r] = len(tokens)

    def append(self, rs: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` [R] appended to rows ``rs`` [R] (distinct), their sequences now ``lengths`` [R] long.
        Returns the rows [R] bool whose token was not the next position: the caller rebuilds those."""
        stale = lengths != self.length[rs] + 1
        self.length[rs[~stale]] = lengths[~stale]
        kept = ~stale & (tokens < self.vocab_size)
        rs, lengths, tokens = rs[kept], lengths[kept], tokens[kept]
        self._fit_ids(tokens)
        new = self.count[rs, tokens] == UNSEEN
        fresh, first = rs[new], tokens[new]
        if len(fresh):
            self._fit(int(self.num_seen[fresh].max()) + 1)
            self.ids[fresh, self.num_seen[fresh]] = first
            self.num_seen[fresh] += 1
            self.count[fresh, first] = 0
        output = lengths - 1 >= self.num_prompt[rs]
        self.count[rs[output], tokens[output]] += 1
        return stale

    def inputs(self, rs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For rows ``rs`` [H]: seen_ids [H, U] int64 (each row's ids padded with its first one, 0 when it
        has none), has_context [H] bool, seen_counts [H, U] float32 (each id's output count)."""
        num_seen = self.num_seen[rs]
        width = max(1, int(num_seen.max()) if len(rs) else 1)
        ids = self.ids[rs, :width]
        has_context = num_seen > 0
        first = np.where(has_context, ids[:, 0], 0)
        ids = np.where(np.arange(width) < num_seen[:, None], ids, first[:, None])
        counts = np.maximum(self.count[rs[:, None], ids], 0)  # a row with no id: its pad 0 is UNSEEN
        return ids, has_context, counts.astype(np.float32)

    def _clear(self, r: int) -> None:
        self.count[r, self.ids[r, :self.num_seen[r]]] = UNSEEN
        self.num_seen[r] = 0
        self.length[r] = 0

    def _add_rows(self, extra: int) -> None:
        start = len(self.num_seen)
        self.count = np.concatenate([self.count, np.full((extra, self.count.shape[1]), UNSEEN, dtype=np.int32)])
        self.ids = np.concatenate([self.ids, np.zeros((extra, self.ids.shape[1]), dtype=np.int64)])
        for name in ("num_seen", "length", "num_prompt"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype=np.int64)]))
        self._free += range(start + extra - 1, start - 1, -1)

    def _fit(self, width: int) -> None:
        """Room for ``width`` distinct ids per row (doubled: a width change copies them all)."""
        if width > self.ids.shape[1]:
            wider = np.zeros((len(self.ids), max(width, 2 * self.ids.shape[1])), dtype=np.int64)
            wider[:, :self.ids.shape[1]] = self.ids
            self.ids = wider

    def _fit_ids(self, ids: np.ndarray) -> None:
        """``count`` wide enough for ``ids`` (doubled, at most V)."""
        width = self.count.shape[1]
        if len(ids) and int(ids.max()) >= width:
            wider = np.full((len(self.count), min(self.vocab_size, max(int(ids.max()) + 1, 2 * width, 1024))), UNSEEN,
                            dtype=np.int32)
            wider[:, :width] = self.count
            self.count = wider
