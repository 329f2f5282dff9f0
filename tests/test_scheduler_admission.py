"""The scheduler's admission (engine/scheduler.py) where the other model-free tests do not look: a
request of n choices is admitted only with a seat for each of its choices still to fork, and a request's
queue time ends at its first admission (a preempted one keeps it: the queue-time metric counts the wait
once). Written for the survivors of `make mutants`'s admission part (docs/testing.md)."""

import time

from engine.block_manager import BlockManager
from engine.request import PendingChoice
from engine.scheduler import Scheduler
from tests.test_scheduler_priority import sequence as _seq  # prompts that share no block


def test_a_request_of_n_choices_waits_for_a_seat_for_each_of_them():
    scheduler = Scheduler(BlockManager(num_blocks=40, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    running = _seq("running", 1, 0, 4)
    scheduler.add(running)
    scheduler.commit(scheduler.schedule())
    three = _seq("three", 1, 1, 4)
    three.pending_choices = [PendingChoice(1, 2), PendingChoice(2, 3)]  # n = 3: two forks to come
    scheduler.add(three)
    assert [s.request_id for s, _ in scheduler.schedule().entries] == ["three"]  # 1 + 3 seats of 4

    tight = Scheduler(BlockManager(num_blocks=40, block_size=4), max_num_seqs=3, max_num_batched_tokens=64)
    first = _seq("first", 1, 0, 4)
    tight.add(first)
    tight.commit(tight.schedule())
    waits = _seq("waits", 1, 1, 4)
    waits.pending_choices = [PendingChoice(1, 2), PendingChoice(2, 3)]
    tight.add(waits)
    assert tight.schedule().entries == [] and tight.waiting == [waits]  # 1 + 3 seats > 3


def test_a_requests_queue_time_ends_at_its_first_admission_and_survives_preemption():
    scheduler = Scheduler(BlockManager(num_blocks=3, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    low = _seq("low", 5, 0, 8)
    before = time.time()
    scheduler.add(low)
    scheduler.commit(scheduler.schedule())
    admitted = low.scheduled_time
    assert admitted is not None and before <= admitted <= time.time()
    high = _seq("high", 1, 1, 8)  # needs 2 of the 3 blocks: low is preempted for it
    scheduler.add(high)
    batch = scheduler.schedule()
    assert batch.preempted == [low] and high.scheduled_time >= admitted
    scheduler.commit(batch)
    scheduler.remove(high)
    scheduler.commit(scheduler.schedule())  # low again
    assert low.scheduled_time == admitted
