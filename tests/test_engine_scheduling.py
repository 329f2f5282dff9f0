"""Priority order, preemption policy, deadlines and aborts: every block comes back."""

import time

import pytest

from engine.block_manager import BlockCounts, BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode, Sequence, SequenceStatus
from engine.scheduler import Scheduler
from sampling import SamplingParams


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def tiny_engine_config():
    return dict(model="tiny-llama", block_size=4, max_num_batched_tokens=64)


def test_priority_order_and_fifo_within_a_level(tiny_engine_config):
    # One request at a time: the order in which they finish is the order they were served.
    engine = LLMEngine(EngineConfig(max_num_seqs=1, **tiny_engine_config))
    order = [("a5", 5), ("b3", 3), ("c1", 1), ("d3", 3), ("e1", 1)]
    for rid, priority in order:
        engine.add_request(GenerationRequest(rid, [5, 6, 7], greedy(3), priority=priority))
    finished = []
    while engine.has_work():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["c1", "e1", "b3", "d3", "a5"]


def _seq(rid: str, priority: int, arrival: int, prompt_len: int) -> Sequence:
    request = GenerationRequest(rid, list(range(3, 3 + prompt_len)), greedy(100), priority=priority)
    return Sequence(request, seed=1, arrival_index=arrival, mode=Mode.GENERATE, deadline=time.time() + 60)


def test_preemption_never_takes_blocks_from_higher_priority():
    """Drive the scheduler alone (no model): 10 blocks of 4 tokens, sequences that grow."""
    blocks = BlockManager(num_blocks=10, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq("p1-early", 1, 0, 8), _seq("p5-a", 5, 1, 8), _seq("p3", 3, 2, 8), _seq("p5-b", 5, 3, 4)]
    for s in seqs:
        scheduler.add(s)
    preempted_log = []
    for _ in range(40):
        batch = scheduler.schedule()
        running_keys = {s.request_id: s.order_key for s, _ in batch.entries}
        for victim in batch.preempted:
            # Every request still scheduled this step is served before the victim.
            assert all(key < victim.order_key for key in running_keys.values()), (victim.request_id, running_keys)
            preempted_log.append(victim.request_id)
        scheduler.commit(batch)  # pretend the model ran: KV computed, one token sampled when due
        for (s, n), due in zip(batch.entries, batch.sampling):
            if due:
                s.token_ids.append(9)
            if s.num_tokens == 16:
                scheduler.remove(s)
        # The prompts share their first blocks: a block held by several sequences counts once.
        assert blocks.num_used == len({b for s in scheduler.running for b in s.block_table})
    assert preempted_log, "the pool was meant to run out"
    assert not scheduler.has_work() and blocks.num_free == blocks.num_blocks
    assert "p1-early" not in preempted_log
    assert preempted_log[0] == "p5-b"  # lowest priority, latest arrival goes first


def test_waiting_high_priority_preempts_running_low_priority():
    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    low = _seq("low", 5, 0, 12)
    scheduler.add(low)
    scheduler.schedule()
    assert blocks.num_free == 1
    high = _seq("high", 1, 1, 12)
    scheduler.add(high)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.preempted] == ["low"]
    assert [s.request_id for s, _ in batch.entries] == ["high"]
    assert [s.request_id for s in scheduler.waiting] == ["low"]


def test_deadline_expiry_frees_blocks(tiny_engine_config):
    engine = LLMEngine(EngineConfig(**tiny_engine_config))
    engine.add_request(GenerationRequest("late", list(range(3, 40)), greedy(10_000), deadline=time.time() + 0.3))
    engine.add_request(GenerationRequest("ok", [5, 6, 7], greedy(5)))
    engine.add_request(GenerationRequest("queued-expired", [5, 6], greedy(5), deadline=time.time() - 1))
    results = {rid: outs[-1] for rid, outs in engine.run_to_completion().items()}
    assert results["late"].finish_reason == "timeout"
    assert results["queued-expired"].finish_reason == "timeout"
    assert results["queued-expired"].num_output_tokens == 0
    assert results["ok"].finish_reason == "length" and results["ok"].num_output_tokens == 5
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_running_and_waiting_frees_blocks(tiny_engine_config):
    engine = LLMEngine(EngineConfig(max_num_seqs=2, **tiny_engine_config))
    for i in range(4):
        engine.add_request(GenerationRequest(f"r{i}", list(range(3, 30)), greedy(50)))
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used > 0
    [running] = engine.abort("r0")
    [waiting] = engine.abort("r3")
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert engine.abort("r0") == []
    results = {rid: outs[-1] for rid, outs in engine.run_to_completion().items()}
    assert set(results) == {"r1", "r2"}
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_stop_conditions(tiny_engine_config):
    engine = LLMEngine(EngineConfig(max_iter_times=7, **tiny_engine_config))
    base = engine.generate([GenerationRequest("base", [5, 6, 7], greedy(12))])["base"]
    ids = base.output_token_ids
    eos_at = ids[3]
    cases = [
        GenerationRequest("max_new", [5, 6, 7], greedy(4)),
        GenerationRequest("cap", [5, 6, 7], greedy(100)),
        GenerationRequest("stop_ids", [5, 6, 7], greedy(12, stop_token_ids=[ids[1:3]])),
        GenerationRequest("end_id", [5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0, eos_token_id=eos_at)),
    ]
    results = engine.generate(cases)
    assert (results["max_new"].finish_reason, results["max_new"].num_output_tokens) == ("length", 4)
    assert (results["cap"].finish_reason, results["cap"].num_output_tokens) == ("length", 7)
    assert results["stop_ids"].finish_reason == "stop_sequence"
    assert results["stop_ids"].output_token_ids == ids[:3]
    assert results["end_id"].finish_reason == "eos_token"
    assert results["end_id"].output_token_ids == ids[: ids.index(eos_at) + 1]


def test_stop_string_is_cut_from_text(tiny_engine_config):
    engine = LLMEngine(EngineConfig(**tiny_engine_config))
    full = engine.generate([GenerationRequest("full", [5, 6, 7], greedy(16))])["full"].text
    stop = full[5:8]
    streams = None
    engine.add_request(GenerationRequest("cut", [5, 6, 7], greedy(16, stop=[stop])))
    streams = engine.run_to_completion()["cut"]
    streamed = "".join(o.new_text for o in streams)
    assert streams[-1].finish_reason == "stop_sequence"
    assert streamed == streams[-1].text == full[: full.find(stop)]


def test_model_length_and_vocabulary_are_enforced(tiny_engine_config):
    engine = LLMEngine(EngineConfig(max_model_len=32, **tiny_engine_config))
    result = engine.generate([GenerationRequest("long", list(range(3, 30)), greedy(100))])["long"]
    assert (result.finish_reason, result.num_output_tokens) == ("length", 32 - 27)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request(GenerationRequest("too-long", list(range(3, 40)), greedy(1)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(GenerationRequest("oov", [engine.vocab_size], greedy(1)))


def test_the_scheduler_alone_admits_what_fits_exactly_counts_and_forgets():
    """The scheduler and the block ledger without a model (the tests `make mutants` runs): a prompt
    that fills the pool to the last block is admitted; max_num_seqs bounds admission; a finished
    prompt's blocks serve the next one as prefix hits, counted as vLLM counts them; a request
    removed while waiting leaves the queue; has_work follows the queues; the counters start at 0."""
    blocks = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=64)
    assert not scheduler.has_work() and scheduler.num_preemptions == 0 and scheduler.num_prompt_tokens_computed == 0
    first = _seq("first", 1, 0, 12)  # 12 tokens: exactly the 3 blocks
    scheduler.add(first)
    assert first.status is SequenceStatus.WAITING and scheduler.has_work()
    batch = scheduler.schedule()
    assert batch.entries == [(first, 12)] and blocks.counts() == BlockCounts(total=3, held=3, cached=0, free=0)
    scheduler.commit(batch)
    assert scheduler.num_prompt_tokens_computed == 12 and scheduler.has_work()
    scheduler.remove(first)  # finished: its three full blocks stay cached
    assert not scheduler.has_work() and blocks.counts() == BlockCounts(total=3, held=0, cached=3, free=0)

    again, other, third = _seq("again", 1, 1, 12), _seq("other", 1, 2, 1), _seq("third", 1, 3, 1)
    for seq in (again, other, third):
        scheduler.add(seq)
    scheduler.remove(other)  # never admitted: it leaves the queue, the others stay in order
    assert scheduler.waiting == [again, third]
    batch = scheduler.schedule()  # the prompt's first 2 blocks are hits; its last token is computed
    assert batch.entries == [(again, 4)] and again.num_computed_tokens == 8
    assert (blocks.prefix_queries, blocks.prefix_hits) == (24, 8)
    scheduler.commit(batch)
    assert scheduler.num_prompt_tokens_computed == 16
    assert scheduler.waiting == [third]  # no block left for it

    crowd = Scheduler(BlockManager(num_blocks=8, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [_seq(f"s{i}", 1, i, 2) for i in range(3)]
    for seq in seqs:
        crowd.add(seq)
    assert [s for s, _ in crowd.schedule().entries] == seqs[:2]  # the third waits for a seat
    assert crowd.waiting == seqs[2:]

    # Prefix blocks still held by a running request are shared, not counted again: two more copies
    # of its prompt need one new block each, and both fit in the two left.
    shared = Scheduler(BlockManager(num_blocks=5, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = _seq("a", 1, 0, 12), _seq("b", 1, 1, 12), _seq("c", 1, 2, 12)
    shared.add(a)
    shared.commit(shared.schedule())  # a runs and keys its 3 full blocks; no token sampled yet
    shared.add(b)
    shared.add(c)
    assert shared.schedule().entries == [(b, 4), (c, 4)] and shared.blocks.num_free == 0
    assert (shared.blocks.prefix_queries, shared.blocks.prefix_hits) == (36, 16)
