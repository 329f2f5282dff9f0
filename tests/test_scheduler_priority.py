"""Priority as an order of service (issue 41, the seeds' "1 is the highest priority"): a request of
higher priority enters the very next step, its prefill chunk ahead of lower-priority chunks in the
token budget, with lower-priority running work preempted where the KV pool or the seats are full;
the preempted request resumes and ends with the tokens of an undisturbed run. The scheduler is
driven alone (no model) where the order is the question, the engine where the tokens are."""

import time

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode, Sequence
from engine.scheduler import Scheduler
from sampling import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def sequence(rid: str, priority: int, arrival: int, prompt_len: int, background: bool = False) -> Sequence:
    """A request whose prompt shares no block with another's (no prefix hits)."""
    first = 1000 * arrival
    request = GenerationRequest(rid, list(range(first, first + prompt_len)), greedy(100), priority=priority,
                                background=background)
    return Sequence(request, seed=1, arrival_index=arrival, mode=Mode.GENERATE, deadline=time.time() + 60)


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """One step as the engine runs it, a token sampled where a chunk ends its sequence; (request, tokens) scheduled."""
    batch = scheduler.schedule()
    scheduler.commit(batch)
    for (seq, _), due in zip(batch.entries, batch.sampling):
        if due:
            seq.token_ids.append(9)
    return [(seq.request_id, n) for seq, n in batch.entries]


def test_a_priority_1_chunk_goes_ahead_of_the_priority_5_chunks_filling_the_budget():
    scheduler = Scheduler(BlockManager(num_blocks=200, block_size=4), max_num_seqs=8, max_num_batched_tokens=32)
    for i in range(3):
        scheduler.add(sequence(f"p5-{i}", 5, i, 200))
    assert step(scheduler) == [("p5-0", 32)]  # the budget is all priority-5 prefill
    scheduler.add(sequence("p1", 1, 3, 40))
    assert step(scheduler) == [("p1", 32)]  # the very next step: its chunk first, the whole budget
    assert step(scheduler) == [("p1", 8), ("p5-0", 24)]  # its last chunk, then priority 5 fills the rest
    scheduler.add(sequence("p3", 3, 4, 8))
    # Within a level the running one keeps its turn; a higher level overtakes it.
    assert step(scheduler) == [("p1", 1), ("p3", 8), ("p5-0", 23)]


def test_a_priority_1_request_takes_a_seat_from_priority_5_when_max_num_seqs_is_full():
    scheduler = Scheduler(BlockManager(num_blocks=200, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(2):
        scheduler.add(sequence(f"p5-{i}", 5, i, 8))
    assert step(scheduler) == [("p5-0", 8), ("p5-1", 8)]
    scheduler.add(sequence("p1", 1, 2, 8))
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.preempted] == ["p5-1"]  # the latest of the lowest priority
    assert [(s.request_id, n) for s, n in batch.entries] == [("p1", 8), ("p5-0", 1)]
    assert [s.request_id for s in scheduler.waiting] == ["p5-1"]


@pytest.mark.slow
def test_a_full_pool_preempts_priority_5_for_priority_1_which_then_resumes_with_the_same_tokens():
    """12 blocks of 4 tokens: priority 5 (24 prompt + 24 new tokens) fills 11 of them after 20
    tokens; priority 1 (12 tokens, 3 blocks) arrives and runs in the very next step; priority 5 is
    recomputed afterwards and ends with the undisturbed run's greedy tokens (float32)."""
    config = EngineConfig(model="tiny-llama", dtype="float32", block_size=4, num_blocks=12, max_num_batched_tokens=64)
    low_prompt, high_prompt = list(range(5, 29)), list(range(40, 52))
    alone = LLMEngine(config).generate([GenerationRequest("low", low_prompt, greedy(24), priority=5)])["low"]

    engine = LLMEngine(config)
    engine.add_request(GenerationRequest("low", low_prompt, greedy(24), priority=5))
    outputs = {"low": [], "high": []}
    for _ in range(20):
        for output in engine.step():
            outputs[output.request_id].append(output)
    assert outputs["low"][-1].num_output_tokens == 20 and engine.blocks.num_free == 1
    engine.add_request(GenerationRequest("high", high_prompt, greedy(4), priority=1))
    first = engine.step()
    assert [o.request_id for o in first] == ["high"] and engine.scheduler.num_preemptions == 1
    outputs["high"] += first
    while engine.has_work():
        for output in engine.step():
            outputs[output.request_id].append(output)
    low, high = outputs["low"][-1], outputs["high"][-1]
    assert high.finished and high.num_output_tokens == 4
    assert low.finished and low.finish_reason == "length"
    assert low.output_token_ids == alone.output_token_ids
    assert engine.blocks.num_free == engine.blocks.num_blocks
