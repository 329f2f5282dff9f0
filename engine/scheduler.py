"""The scheduler decides, each step, which tokens of which requests run.

Policy:
- order: priority 1..5 (1 first), FIFO within a level (``Sequence.order_key``). Priority is an
  order of service (the seeds' "1 is the highest"): a request enters the very next step
  whatever lower-priority work fills it;
- background requests (Batch API lines, ``GenerationRequest.background``) rank below every
  foreground one, whatever the priorities, and run only in steps no foreground request is in:
  while one waits, its KV has just arrived, or it runs, a background request is not admitted
  and a running one is held (in the running batch, its KV kept, no tokens this step), so the
  foreground requests' steps are as short as if no batch ran. Once none is left the held ones
  run on where they stopped. A background request whose KV comes from P is still admitted into
  ``receiving`` (a fetch, no compute), so that P's copy is taken within its lease;
- the step's token budget is handed out in that order: a decoding request takes 1 token
  (1 + k with k draft tokens to verify, as many as the budget leaves room for), a prefilling
  one a chunk of its prompt (chunked prefill). Within a level running requests come before
  waiting ones; a waiting request of higher priority than a running one is admitted before
  that running one takes its share, so its chunk goes ahead of lower-priority chunks;
- waiting requests are admitted in order while blocks, the token budget and ``max_num_seqs``
  allow; admission stops at the first that does not fit, so a later, smaller request never
  overtakes it;
- when a running request cannot get a block, the lowest-priority, most recently arrived
  running request is preempted (blocks freed, requeued for recomputation), which may be the
  request itself; a request never preempts one of higher rank (``Sequence.rank``: foreground,
  then priority). The first waiting request preempts running (or held) requests of strictly
  lower rank, lowest and latest first, until it has
  the blocks for its first chunk and a seat in ``max_num_seqs``; a preempted request resumes
  from its prompt and generated tokens (prefix hits keep that cheap) and ends as it would have.
- prefix caching: a waiting request first takes the cached blocks that hold its leading full
  blocks (``BlockManager.computed_prefix``) and computes from there; a request whose KV
  arrives from P takes its hits and imports only the rest; a request that scores its prompt
  (prompt logprobs) takes none and computes it whole;
- a request whose KV has not arrived yet (DECODE, SGLang's and vLLM's "waiting for remote KV")
  is admitted like any other, with blocks for that KV, but into ``receiving``: it runs once the
  bytes are there (``kv_arrived``). So a D replica pulls a prompt's KV only when it has room for
  it, and never pulls KV that would wait in its queue;
- a request with n choices is admitted as one sequence; the others fork from it once its
  prompt is computed (``fork``), so admission keeps room in ``max_num_seqs`` for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import bisect
import heapq
from itertools import chain
import time

import numpy as np

from engine.block_manager import BlockManager
from engine.execution.persistent_batch import PersistentBatch
from engine.request import PRIORITY_MAX, PRIORITY_MIN, PendingChoice, Sequence, SequenceStatus

Rank = tuple[bool, int]  # Sequence.rank: (background, priority); smaller is served first
EVERY_RANK: Rank = (True, PRIORITY_MAX + 1)  # a bound above every rank: nothing held
FOREGROUND_RANKS: Rank = (True, PRIORITY_MIN)  # a bound above foreground ranks only: background held


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    sampling: list[bool] = field(default_factory=list)  # per entry: its chunk reaches its last token
    # Per entry: draft tokens run after its last token (engine/decoding/speculative.py), 0 for most.
    drafted: list[int] = field(default_factory=list)
    # (sequence, first token to import): write pending KV from there on, before the forward;
    # the tokens before it were prefix-cache hits.
    kv_imports: list[tuple[Sequence, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)
    kv_wanted: list[Sequence] = field(default_factory=list)  # admitted into receiving: fetch their KV now
    unservable: list[tuple[Sequence, str]] = field(default_factory=list)  # taken out of the queue, with why
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [E]: each entry's row slot
    # Every entry one decode token (no prompt, no drafts): its inputs are gathers of the persistent batch.
    decode_only: bool = False


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 rows: PersistentBatch | None = None) -> None:
        """``rows``: the running sequences' columns, joined and left here (default: tables as wide
        as the pool, no vocabulary to clamp top-k to)."""
        self.blocks = blocks
        self.rows = rows if rows is not None else PersistentBatch(max_num_seqs, blocks.num_blocks, vocab_size=2**62)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: list[tuple[tuple[bool, int, int, int], Sequence]] = []  # heap by order_key
        self.running: list[Sequence] = []
        # ``running`` in service order (``Sequence.order_key``), kept at each join and leave so that
        # a step needs no sort of its rows: the keys, and the sequences at the same places.
        self._order_keys: list[tuple[bool, int, int, int]] = []
        self._ordered: list[Sequence] = []
        self.receiving: list[Sequence] = []  # blocks held, KV bytes not here yet
        # KV here: they join the running batch at the next step (a background one at the first it may run in)
        self._arrived: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (not hits, not imports)

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for _, seq in sorted(self._waiting, key=lambda item: item[0])]

    def has_work(self) -> bool:
        """Whether a step can make progress. A sequence that waits for its KV cannot, and while
        one holds blocks nothing waiting can be admitted that was not at the last step (new
        requests and arriving KV wake the engine's loop, which then steps)."""
        runnable_arrivals = any(seq.rank < self._step_bound() for seq in self._arrived)
        return bool(self.running or runnable_arrivals or (self._waiting and not self.receiving))

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens still to run through the model: waiting prompts (not those whose KV comes
        imported) and the rest of running ones. P's autoscaling signal."""
        waiting = sum(seq.num_tokens for _, seq in self._waiting if seq.pending_kv is None)
        return waiting + sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in self.running)

    def kv_arrived(self, seq: Sequence) -> None:
        """A receiving sequence's KV bytes are in ``seq.pending_kv``: it runs from the next step."""
        self.receiving.remove(seq)
        self._arrived.append(seq)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.order_key, seq))

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give back its blocks (finish, abort, expiry)."""
        self.rows.leave(seq)
        if seq in self.running:
            self._stop_running(seq)
        elif seq in self.receiving:
            self.receiving.remove(seq)
        elif seq in self._arrived:
            self._arrived.remove(seq)
        else:
            self._waiting = [item for item in self._waiting if item[1] is not seq]
            heapq.heapify(self._waiting)
        self.blocks.free(seq)

    def fork(self, parent: Sequence, choice: PendingChoice) -> Sequence:
        """Start a sibling choice of a running ``parent`` on the parent's computed prompt."""
        return self._run_beside(parent, parent.fork(choice))

    def clone(self, parent: Sequence, index: int) -> Sequence:
        """Start a beam as a copy of a running ``parent`` (blocks shared, the tail copied on write)."""
        return self._run_beside(parent, parent.clone(index))

    def _run_beside(self, parent: Sequence, child: Sequence) -> Sequence:
        self.blocks.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self._run(child)
        return child

    def _run(self, seq: Sequence) -> None:
        """``seq`` joins the running batch (and the persistent batch's rows)."""
        self.running.append(seq)
        key = seq.order_key
        at = bisect.bisect(self._order_keys, key)
        self._order_keys.insert(at, key)
        self._ordered.insert(at, seq)
        self.rows.join(seq)

    def _stop_running(self, seq: Sequence) -> None:
        """``seq`` leaves ``running`` (its row is the caller's)."""
        self.running.remove(seq)
        at = bisect.bisect_left(self._order_keys, seq.order_key)
        if at == len(self._ordered) or self._ordered[at] is not seq:  # a key shared with another: by identity
            at = next(i for i, s in enumerate(self._ordered) if s is seq)
        del self._order_keys[at]
        del self._ordered[at]

    def commit(self, batch: ScheduledBatch, rejected: list[int] | None = None) -> None:
        """The forward ran: the scheduled tokens are computed, less each entry's ``rejected``
        drafts (their KV is garbage, overwritten later), and their full blocks are cached.
        Accepted drafts count as computed before the engine appends them to the sequence."""
        if batch.decode_only and not any(rejected or ()):  # one token each, none of the prompt
            seqs = [seq for seq, _ in batch.entries]
            for seq in seqs:
                seq.num_computed_tokens += 1
            self.blocks.cache_filled_blocks(seqs)
            self.rows.num_computed[batch.slots] += 1
            return
        for (seq, n), dropped in zip(batch.entries, rejected or [0] * len(batch.entries)):
            start = seq.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(start + n, seq.num_prompt_tokens) - start)
            seq.num_computed_tokens = start + n - dropped
            self.rows.write_computed(seq)
            self.blocks.cache_full_blocks(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bound = self._step_bound()  # ranks at or past it are held this step
        self._preempt_for_waiting(batch)
        preempted_for_waiting = len(batch.preempted)
        # Imported before this step's forward, then computed like the rest; a held one stays (its
        # import needs a forward to run in), preemptible for a waiting request's blocks.
        joining = [seq for seq in self._arrived if seq.rank < bound]
        self._arrived = [seq for seq in self._arrived if seq.rank >= bound]
        for seq in joining:
            batch.kv_imports.append((seq, seq.kv_import_from))
            seq.status = SequenceStatus.RUNNING
            self._run(seq)
        budget, decodes = self._schedule_running(batch, budget, bound)
        # Running requests that lost blocks this step come before anything new.
        if len(batch.preempted) == preempted_for_waiting:
            self._admit(batch, budget, bound, fetch_held=True)
        rest = batch.entries[decodes:]  # the leading ``decodes`` entries are one decode token each
        batch.drafted = [0] * decodes + [max(0, seq.num_computed_tokens + n - seq.num_tokens) for seq, n in rest]
        batch.sampling = [True] * decodes + [seq.num_computed_tokens + n >= seq.num_tokens for seq, n in rest]
        self._mark_decode(batch, decodes)
        return batch

    def _step_bound(self) -> Rank:
        """The rank bound of this step: background requests are held while a foreground one waits,
        has its KV just arrived, or runs (a foreground one waits at the heap's head if any does)."""
        foreground = ((self._waiting and not self._waiting[0][1].background)
                      or any(not seq.background for seq in chain(self.running, self._arrived)))
        return FOREGROUND_RANKS if foreground else EVERY_RANK

    def _schedule_running(self, batch: ScheduledBatch, budget: int, bound: Rank) -> tuple[int, int]:
        """The running sequences' tokens, in order (those ranked at or past ``bound`` held), and waiting
        requests of higher rank admitted before the first they outrank: (the budget left, how many
        leading entries are one decode token)."""
        # A copy: preempting a row below takes it out of ``_ordered``.
        ordered = list(self._ordered) if bound == EVERY_RANK else [s for s in self._ordered if s.rank < bound]
        slots = self._all_decode(ordered, budget)
        if slots is not None:
            return self._schedule_decodes(batch, budget, ordered, slots)
        may_overtake = True  # False once a waiting request of higher priority found no room this step
        for seq in ordered:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if may_overtake and self._waiting and self._waiting[0][1].rank < seq.rank:
                budget = self._admit(batch, budget, below=seq.rank)  # its chunk before this one's
                may_overtake = not (self._waiting and self._waiting[0][1].rank < seq.rank)
                if budget == 0:
                    break
            n = self._new_tokens(seq, seq.num_computed_tokens, budget)
            if n == 0:  # a beam that has reported its step waits for its siblings (engine/decoding/beam_search.py)
                continue
            if not self.blocks.covers(seq, seq.num_computed_tokens + n) and not self._grow(seq, n, batch):
                continue
            batch.entries.append((seq, n))
            budget -= n
        return budget, 0

    def _all_decode(self, ordered: list[Sequence], budget: int) -> np.ndarray | None:
        """The row slots [R] of ``ordered`` when each has one token left to compute and no drafts, the
        budget holds them all and no waiting request outranks one (the loop above would give each
        one token, admitting nothing between them); else None."""
        if not ordered or len(ordered) > budget:
            return None
        if self._waiting and self._waiting[0][1].rank < ordered[-1].rank:  # ordered by rank first: the last is the lowest
            return None
        if any(seq.step_drafts is not None and seq.step_drafts.token_ids for seq in ordered):
            return None
        slots = np.fromiter((seq.row for seq in ordered), dtype=np.int64, count=len(ordered))
        rows = self.rows
        return slots if bool((rows.num_tokens[slots] - rows.num_computed[slots] == 1).all()) else None

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int, ordered: list[Sequence],
                          slots: np.ndarray) -> tuple[int, int]:
        """One token for each of ``ordered`` (slots [R]): block coverage decided for the whole batch
        from the persistent batch's tables, a block found (or room made) only for the rows that need one."""
        rows, blocks = self.rows, self.blocks
        lengths = rows.table_len[slots]
        # The tables as wide as the longest in use (a copy of [R, max_model_len / block_size] costs more than the rest)
        tables = rows.tables[slots, :max(1, int(lengths.max()))]
        covered = blocks.covered(tables, lengths, rows.num_computed[slots] + 1)
        short = np.flatnonzero(~covered)
        if len(short) <= blocks.num_free:  # one block each (a new one, or a shared tail's copy): nobody preempted
            grown = [ordered[i] for i in short.tolist()]
            for seq in grown:  # in order, as the loop below takes them
                batch.block_copies += blocks.allocate(seq, seq.num_computed_tokens + 1)
            rows.write_grown(slots[short], rows.num_computed[slots[short]] // blocks.block_size, grown)
            batch.entries += [(seq, 1) for seq in ordered]
            batch.slots = slots
            return budget - len(ordered), len(ordered)
        kept = []
        for seq, covers in zip(ordered, covered.tolist()):
            # A row preempted for an earlier row's block is out; a row whose own growth preempted it too.
            kept.append(seq.status is SequenceStatus.RUNNING and (covers or self._grow(seq, 1, batch)))
            if kept[-1]:
                batch.entries.append((seq, 1))
        batch.slots = slots[np.array(kept, dtype=bool)]
        return budget - len(batch.slots), len(batch.slots)

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``seq``'s next n tokens, preempting for them; False if ``seq`` itself was preempted."""
        if not self._make_room(seq, n, batch):
            return False
        batch.block_copies += self.blocks.allocate(seq, seq.num_computed_tokens + n)
        self.rows.write_blocks(seq)
        return True

    def _mark_decode(self, batch: ScheduledBatch, decodes: int) -> None:
        """The entries' row slots (``batch.slots`` holds the leading ``decodes``' already), and whether
        every entry is one decode token (from the columns)."""
        rest = batch.entries[decodes:]
        if rest:
            tail = np.fromiter((seq.row for seq, _ in rest), dtype=np.int64, count=len(rest))
            batch.slots = np.concatenate([batch.slots[:decodes], tail])
        if not batch.entries or any(n != 1 for _, n in rest):
            return
        rows, slots = self.rows, batch.slots
        batch.decode_only = bool(((rows.num_computed[slots] >= rows.num_prompt[slots])
                                  & (rows.num_computed[slots] + 1 == rows.num_tokens[slots])).all())

    def _admit(self, batch: ScheduledBatch, budget: int, below: Rank, fetch_held: bool = False) -> int:
        """Admit waiting requests ranked under ``below`` in order; the budget left. ``fetch_held``: one
        ranked past it whose KV is still to come from P is admitted too, into ``receiving`` (a fetch
        runs no step; it joins the running batch once it may run)."""
        while self._waiting and budget > 0 and self._has_room_for(self._waiting[0][1]):
            seq = self._waiting[0][1]
            if seq.rank >= below and not (fetch_held and seq.pending_kv is not None and seq.pending_kv.data is None):
                break
            hits = self._prefix_hits(seq)
            hit_tokens = len(hits) * self.blocks.block_size
            computed, n = self._first_chunk(seq, hit_tokens, budget)
            if seq.pending_kv is not None and seq.pending_kv.meta.start > hit_tokens:
                heapq.heappop(self._waiting)
                batch.unservable.append((seq, f"kv.start: the KV sent begins at token {seq.pending_kv.meta.start}, "
                                              f"and this engine holds only the first {hit_tokens}"))
                continue
            if not self.blocks.can_allocate(seq, computed + n, hits):
                break
            heapq.heappop(self._waiting)
            self.blocks.record_lookup(seq.num_tokens, hit_tokens)
            batch.block_copies += self.blocks.allocate(seq, computed + n, hits)
            seq.num_computed_tokens = computed
            if seq.scheduled_time is None:  # the end of its queue time (a preempted one keeps its first)
                seq.scheduled_time = time.time()
            if seq.pending_kv is not None:
                seq.kv_import_from = hit_tokens
                if seq.pending_kv.data is None:  # ask for the bytes; run once they are here
                    seq.status = SequenceStatus.RECEIVING
                    self.receiving.append(seq)
                    batch.kv_wanted.append(seq)
                    continue
                batch.kv_imports.append((seq, seq.kv_import_from))
            seq.status = SequenceStatus.RUNNING
            self._run(seq)
            batch.entries.append((seq, n))
            budget -= n
        return budget

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        return [] if seq.scores_prompt else self.blocks.computed_prefix(seq)

    def _has_room_for(self, seq: Sequence) -> bool:
        """A request is admitted with room for its choices still to fork (unless nothing runs)."""
        active = len(self.running) + len(self.receiving) + len(self._arrived)
        return not active or active + 1 + len(seq.pending_choices) <= self.max_num_seqs

    @staticmethod
    def _new_tokens(seq: Sequence, computed: int, budget: int) -> int:
        """Tokens to run from ``computed`` on: the rest of the sequence, and its drafts when only its
        last token is left (engine/decoding/speculative.py), within the budget."""
        remaining = seq.num_tokens - computed
        drafts = len(seq.step_drafts.token_ids) if remaining == 1 and seq.step_drafts is not None else 0
        return min(remaining + drafts, budget)

    def _first_chunk(self, seq: Sequence, hit_tokens: int, budget: int) -> tuple[int, int]:
        """(tokens computed on admission: prefix hits, or the prompt when its KV arrives imported;
        tokens to compute now) for a waiting sequence."""
        computed = seq.pending_kv.meta.num_tokens if seq.pending_kv is not None else hit_tokens
        return computed, self._new_tokens(seq, computed, budget)

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Preempt until ``seq`` can grow by n tokens; False if ``seq`` itself was preempted."""
        while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
            victim = max(self._preemptible(), key=lambda s: s.order_key)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt_for_waiting(self, batch: ScheduledBatch) -> None:
        """Free blocks and a seat for the first waiting request by preempting lower-ranked running (or
        held) ones."""
        if not self._waiting:
            return
        head = self._waiting[0][1]
        hits = self._prefix_hits(head)
        computed, n = self._first_chunk(head, len(hits) * self.blocks.block_size, self.max_num_batched_tokens)
        while not (self.blocks.can_allocate(head, computed + n, hits) and self._has_room_for(head)):
            lower = [s for s in self._preemptible() if s.rank > head.rank]
            if not lower:
                return
            self._preempt(max(lower, key=lambda s: s.order_key), batch)

    def _preemptible(self) -> list[Sequence]:
        """The running sequences, and the background ones held with their KV just arrived."""
        return self.running + [s for s in self._arrived if s.background]

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if seq in self._arrived:  # held with its KV here: not in the running batch's rows
            self._arrived.remove(seq)
        else:
            self._stop_running(seq)
            self.rows.leave(seq)
        self.blocks.free(seq)
        # A sequence whose KV just arrived keeps it in pending_kv and imports it on readmission.
        batch.kv_imports = [(s, first) for s, first in batch.kv_imports if s is not seq]
        seq.num_computed_tokens = 0  # recomputed on readmission (prefix hits make that cheap)
        batch.preempted.append(seq)
        self.num_preemptions += 1
        self.add(seq)
