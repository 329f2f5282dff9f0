"""The ids each penalised row has seen, kept as it goes: what the repetition, presence and frequency
penalties read at a step, updated by each appended token instead of re-read from the whole context.

A row that asks for a penalty gets a counter row ``r`` when it joins. ``ids[r, :num_seen[r]]`` are
the distinct real ids of its context (prompt tokens below the vocabulary, and outputs);
``counts[r, k]`` is how often ``ids[r, k]`` occurs in its output; ``delta[r, k]`` is what the
presence and frequency penalties take from its logit (``frequency * count + presence * (count > 0)``
in float32, as the per-row path computes it: it changes only with the count); ``at[r, id]`` is
where ``id`` sits in ``ids[r]``, ``UNSEEN`` where it is not in the context (4 bytes per id up to the
largest seen, at most V, per penalised row). Past ``num_seen[r]``, ``ids[r]`` and ``delta[r]``
repeat their first entry (0 and 0 in a row with none): the pads ``ProcessorInputs`` needs, kept in
place. An appended token costs one lookup and a few writes (its row's pads rewritten only when its
first entry changes); a step's inputs are two row gathers of ``[H, U]`` (U: the most distinct ids
of a step's rows), never a read of the contexts ``[H, L]``.

    r = seen.join(tokens, num_prompt, presence, frequency)  # once: join, resume, fork, clone
    stale = seen.append(rs, lengths, tokens)    # one token each for rows ``rs`` (distinct)
    seen.rebuild(r, tokens)                     # a stale row: its token was not its next position
    seen.inputs(rs)                             # ProcessorInputs' seen_ids, has_context, seen_delta
    seen.leave(r)
"""

from __future__ import annotations

import numpy as np

UNSEEN = -1


class SeenIds:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.ids = np.zeros((0, 16), dtype=np.int64)  # [rows, width]: the distinct ids seen, num_seen of them
        self.counts = np.zeros((0, 16), dtype=np.float32)  # [rows, width]: each one's output count (exact < 2**24)
        self.delta = np.zeros((0, 16), dtype=np.float32)  # [rows, width]: its presence and frequency penalty
        # [rows, W]: an id's place in ``ids``, UNSEEN where it is not in the context; W grows to the largest
        # id seen (at most V): the scheduler's own batch has no vocabulary (V = 2**62).
        self.at = np.zeros((0, 1), dtype=np.int32)
        self.num_seen = np.zeros(0, dtype=np.int64)  # [rows]
        self.length = np.zeros(0, dtype=np.int64)  # [rows]: the sequence's tokens folded in
        self.num_prompt = np.zeros(0, dtype=np.int64)  # [rows]: positions below it are the prompt's (not counted)
        self.presence = np.zeros(0, dtype=np.float32)  # [rows]
        self.frequency = np.zeros(0, dtype=np.float32)  # [rows]
        self._free: list[int] = []

    def join(self, tokens: np.ndarray, num_prompt: int, presence: float, frequency: float) -> int:
        """A counter row for a sequence of ``tokens`` [L] (its first ``num_prompt`` the prompt's) and
        its request's penalties."""
        if not self._free:
            self._add_rows(max(4, len(self.num_seen)))
        r = self._free.pop()
        self.num_prompt[r], self.presence[r], self.frequency[r] = num_prompt, presence, frequency
        self.rebuild(r, tokens)
        return r

    def leave(self, r: int) -> None:
        self._clear(r)
        self._free.append(r)

    def rebuild(self, r: int, tokens: np.ndarray) -> None:
        """Row ``r`` counted afresh from its sequence's ``tokens`` [L] (all of them)."""
        self._clear(r)
        distinct = np.unique(tokens[tokens < self.vocab_size])
        n = len(distinct)
        self._fit(n)
        self._fit_ids(distinct)
        self.ids[r, :n] = distinct
        self.at[r, distinct] = np.arange(n)
        outputs = tokens[self.num_prompt[r]:]
        self.counts[r, :n] = np.bincount(self.at[r, outputs[outputs < self.vocab_size]], minlength=n)
        self.delta[r, :n] = self._delta(np.full(n, r), self.counts[r, :n])
        self.num_seen[r] = n
        self._pad(r)
        self.length[r] = len(tokens)

    def append(self, rs: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` [R] appended to rows ``rs`` [R] (distinct), their sequences now ``lengths`` [R] long.
        Returns the rows [R] bool whose token was not the next position: the caller rebuilds those."""
        stale = lengths != self.length[rs] + 1
        self.length[rs[~stale]] = lengths[~stale]
        kept = ~stale & (tokens < self.vocab_size)
        rs, lengths, tokens = rs[kept], lengths[kept], tokens[kept]
        self._fit_ids(tokens)
        places = self.at[rs, tokens].astype(np.int64)
        new = places == UNSEEN
        if new.any():
            fresh = rs[new]
            places[new] = self.num_seen[fresh]
            self._fit(int(places[new].max()) + 1)
            self.ids[fresh, places[new]] = tokens[new]
            self.counts[fresh, places[new]] = 0
            self.delta[fresh, places[new]] = 0
            self.at[fresh, tokens[new]] = places[new]
            self.num_seen[fresh] += 1
        output = lengths - 1 >= self.num_prompt[rs]
        counted, at = rs[output], places[output]
        self.counts[counted, at] += 1
        self.delta[counted, at] = self._delta(counted, self.counts[counted, at])
        for r in np.unique(rs[places == 0]).tolist():  # a row's first entry changed: its pads follow
            self._pad(r)
        return stale

    def _delta(self, rs: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """float32 ``frequency * counts + presence * (counts > 0)`` of rows ``rs``: the per-row path's
        operations (sampling/processors.py ``penalty_delta``), each rounded to float32, so the same bits."""
        return self.frequency[rs] * counts + self.presence[rs] * (counts > 0).astype(np.float32)

    def inputs(self, rs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For rows ``rs`` [H]: seen_ids [H, U] int64 and seen_delta [H, U] float32 (padded), and
        has_context [H] bool."""
        num_seen = self.num_seen[rs]
        width = max(1, int(num_seen.max()) if len(rs) else 1)
        return self.ids[rs, :width], num_seen > 0, self.delta[rs, :width]

    def _pad(self, r: int) -> None:
        """Row ``r``'s pads (past its ids) set to its first entry."""
        n = self.num_seen[r]
        self.ids[r, n:] = self.ids[r, 0]
        self.delta[r, n:] = self.delta[r, 0]

    def _clear(self, r: int) -> None:
        self.at[r, self.ids[r, :self.num_seen[r]]] = UNSEEN
        self.ids[r], self.counts[r], self.delta[r] = 0, 0, 0
        self.num_seen[r] = 0
        self.length[r] = 0

    def _add_rows(self, extra: int) -> None:
        start = len(self.num_seen)
        self.at = np.concatenate([self.at, np.full((extra, self.at.shape[1]), UNSEEN, dtype=np.int32)])
        for name in ("ids", "counts", "delta"):
            table = getattr(self, name)
            setattr(self, name, np.concatenate([table, np.zeros((extra, table.shape[1]), dtype=table.dtype)]))
        for name in ("num_seen", "length", "num_prompt"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype=np.int64)]))
        for name in ("presence", "frequency"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype=np.float32)]))
        self._free += range(start + extra - 1, start - 1, -1)

    def _fit(self, width: int) -> None:
        """Room for ``width`` distinct ids per row (doubled: a width change copies them all; the new
        columns are pads, each row's first entry)."""
        if width > self.ids.shape[1]:
            for name in ("ids", "counts", "delta"):
                table = getattr(self, name)
                wider = np.empty((len(table), max(width, 2 * table.shape[1])), dtype=table.dtype)
                wider[:, :table.shape[1]] = table
                wider[:, table.shape[1]:] = table[:, :1] if name != "counts" else 0
                setattr(self, name, wider)

    def _fit_ids(self, ids: np.ndarray) -> None:
        """``at`` wide enough for ``ids`` (doubled, at most V)."""
        width = self.at.shape[1]
        if len(ids) and int(ids.max()) >= width:
            wider = np.full((len(self.at), min(self.vocab_size, max(int(ids.max()) + 1, 2 * width, 1024))), UNSEEN,
                            dtype=np.int32)
            wider[:, :width] = self.at
            self.at = wider
