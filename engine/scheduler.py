"""The scheduler decides, each step, which tokens of which requests run.

Policy:
- order: priority 1..5 (1 first), FIFO within a level (``Sequence.order_key``);
- running requests first, in that order: a decoding request takes 1 token of the step's
  budget, a prefilling one a chunk of its prompt (chunked prefill);
- then waiting requests are admitted in that order while blocks, the token budget and
  ``max_num_seqs`` allow; admission stops at the first that does not fit, so a later,
  smaller request never overtakes it;
- when a running request cannot get a block, the lowest-priority, most recently arrived
  running request is preempted (blocks freed, requeued for recomputation), which may be the
  request itself; a request never preempts one of higher priority. A waiting request
  preempts only running requests of strictly lower priority.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import heapq

from engine.block_manager import BlockManager
from engine.request import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    kv_imports: list[Sequence] = field(default_factory=list)  # write their pending KV before the forward
    preempted: list[Sequence] = field(default_factory=list)

    def samples(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether this step's chunk reaches the sequence's last token, so it samples the next one."""
        return seq.num_computed_tokens + num_new_tokens == seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by order_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for _, seq in sorted(self._waiting, key=lambda item: item[0])]

    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.order_key, seq))

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give back its blocks (finish, abort, expiry)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self._waiting = [item for item in self._waiting if item[1] is not seq]
            heapq.heapify(self._waiting)
        self.blocks.free(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self._preempt_for_waiting(batch)
        preempted_for_waiting = len(batch.preempted)
        for seq in sorted(self.running, key=lambda s: s.order_key):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, batch):
                continue
            self.blocks.grow(seq, n)
            batch.entries.append((seq, n))
            budget -= n
        # Running requests that lost blocks this step come before anything new.
        if len(batch.preempted) == preempted_for_waiting:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._waiting[0][1]
            cached, n = self._first_chunk(seq, budget)
            if self.blocks.blocks_needed(seq, cached + n) > self.blocks.num_free:
                break
            heapq.heappop(self._waiting)
            self.blocks.grow(seq, cached + n)
            if seq.pending_kv is not None:
                seq.num_computed_tokens = cached
                batch.kv_imports.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n

    @staticmethod
    def _first_chunk(seq: Sequence, budget: int) -> tuple[int, int]:
        """(tokens whose KV arrives imported, tokens to compute now) for a waiting sequence."""
        cached = seq.pending_kv.meta.num_tokens if seq.pending_kv is not None else 0
        return cached, min(seq.num_tokens - cached, budget)

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Preempt until ``seq`` can grow by n tokens; False if ``seq`` itself was preempted."""
        while not self.blocks.can_grow(seq, n):
            victim = max(self.running, key=lambda s: s.order_key)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt_for_waiting(self, batch: ScheduledBatch) -> None:
        """Free blocks for the first waiting request by preempting lower-priority running ones."""
        if not self._waiting:
            return
        head = self._waiting[0][1]
        cached, n = self._first_chunk(head, self.max_num_batched_tokens)
        while self.blocks.blocks_needed(head, cached + n) > self.blocks.num_free:
            lower = [s for s in self.running if s.priority > head.priority]
            if not lower:
                return
            self._preempt(max(lower, key=lambda s: s.order_key), batch)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1
        self.add(seq)
