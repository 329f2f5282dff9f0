"""Content-addressed KV blocks: prefix caching, forks with copy-on-write, n choices from one
prefill, KV import into the cache, and block accounts that come back to baseline."""

import time

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode, PendingChoice, Sequence
from sampling import SamplingParams
from sampling.params import choice_seed

SYSTEM = list(range(3, 43))  # a 40-token shared prefix: 10 blocks of 4


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def sampled(n: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, top_k=50, ignore_eos=True, seed=seed)


def make_engine(prefix_caching: bool = True, **kw) -> LLMEngine:
    # float64: on and off must agree token for token, whatever the chunking of the context.
    config = dict(model="tiny-llama", dtype="float64", block_size=4, max_num_batched_tokens=64,
                  enable_prefix_caching=prefix_caching)
    return LLMEngine(EngineConfig(**{**config, **kw}))


def assert_all_blocks_back(engine: LLMEngine) -> None:
    counts = engine.block_counts()
    assert counts.held == 0 and counts.cached + counts.free == counts.total
    assert not any(engine.blocks.ref_count)


def conversation_prompts() -> list[list[int]]:
    """Prompts sharing the system prefix, and a second turn that extends the first."""
    first = SYSTEM + [50, 51, 52, 53, 54, 55, 56]
    return [first, SYSTEM + [60, 61, 62], first + [70, 71, 72, 73, 74], SYSTEM[:17], SYSTEM + [50, 51]]


def run_in_turn(engine: LLMEngine, prompts: list[list[int]], params_for) -> list[list[int]]:
    """One request after another, so each finds the blocks the ones before it left."""
    outputs = []
    for i, prompt in enumerate(prompts):
        outputs.append(engine.generate([GenerationRequest(f"r{i}", prompt, params_for(i))])[f"r{i}"].output_token_ids)
    return outputs


@pytest.mark.parametrize("params_for", [lambda i: greedy(8), lambda i: sampled(8, seed=100 + i)],
                         ids=["greedy", "seeded"])
def test_prefix_caching_on_and_off_give_the_same_tokens(params_for):
    on, off = make_engine(True), make_engine(False)
    prompts = conversation_prompts()
    cached = run_in_turn(on, prompts, params_for)
    assert cached == run_in_turn(off, prompts, params_for)
    # The cache was used: every prompt after the first finds at least the system prefix's blocks.
    assert on.blocks.prefix_hits >= 4 * 16 and off.blocks.prefix_hits == 0
    assert on.scheduler.num_prompt_tokens_computed < off.scheduler.num_prompt_tokens_computed
    assert_all_blocks_back(on)
    assert_all_blocks_back(off)


def test_prefix_caching_under_eviction_and_preemption():
    """A pool too small for every request at once: blocks are evicted and requests preempted,
    and the tokens still equal the run without caching."""
    prompts = [SYSTEM + [100 + i] * (3 + i) for i in range(6)]
    requests = lambda: [GenerationRequest(f"r{i}", p, sampled(24, seed=7 + i)) for i, p in enumerate(prompts)]  # noqa: E731
    on = make_engine(True, num_blocks=40)
    off = make_engine(False, num_blocks=40)
    got = {rid: out.output_token_ids for rid, out in on.generate(requests()).items()}
    want = {rid: out.output_token_ids for rid, out in off.generate(requests()).items()}
    assert got == want
    assert on.scheduler.num_preemptions > 0 and off.scheduler.num_preemptions > 0
    # Run again: some of the first round's blocks were evicted, some are still there.
    again = {rid: out.output_token_ids for rid, out in on.generate(requests()).items()}
    assert again == want
    assert on.blocks.prefix_hits > 0
    assert_all_blocks_back(on)


def test_n_choices_share_one_prefill_and_equal_separate_requests():
    prompt = SYSTEM + [80, 81, 82]  # 43 tokens: the last block is partial, so the forks copy it on write
    engine = make_engine(False)
    [choices] = engine.generate_choices([GenerationRequest("n", prompt, sampled(12, seed=42), n=4)]).values()
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert engine.scheduler.num_prompt_tokens_computed == len(prompt)  # one prefill for four choices
    separate = make_engine(False)
    for j, choice in enumerate(choices):
        alone = separate.generate([GenerationRequest(f"s{j}", prompt, sampled(12, seed=choice_seed(42, j)))])
        assert choice.output_token_ids == alone[f"s{j}"].output_token_ids
        assert choice.seed == choice_seed(42, j)
    assert len({tuple(c.output_token_ids) for c in choices}) > 1  # the choices are not copies of each other
    assert_all_blocks_back(engine)


def test_n_choices_through_prefill_and_decode_engines():
    """P prefills once and sends one KV for all choices; D forks them: the same tokens as colocated."""
    prompt = SYSTEM + [90, 91]
    request = GenerationRequest("pd", prompt, sampled(10, seed=5), n=3)
    colocated = make_engine().generate_choices([request])["pd"]
    p, d = make_engine(), make_engine()
    p.add_request(request, Mode.PREFILL)
    firsts = [out for outs in p.run_to_completion().values() for out in outs]
    handoff = firsts[0].prefill
    assert {c.index for c in handoff.choices} == {0, 1, 2} and handoff.kv.meta.num_tokens == len(prompt)
    assert p.scheduler.num_prompt_tokens_computed == len(prompt)
    d.add_request(request, Mode.DECODE, handoff)
    decoded = LLMEngine.final_choices(d.run_to_completion())["pd"]
    assert [o.output_token_ids for o in decoded] == [o.output_token_ids for o in colocated]
    assert d.scheduler.num_prompt_tokens_computed == 0  # D computed no prompt token: imported once
    assert_all_blocks_back(p)
    assert_all_blocks_back(d)


def test_decode_reuses_imported_kv_and_takes_a_partial_export():
    """KV imported on D enters its prefix cache: a follow-up request that shares the prompt's
    start is sent only the KV after what D holds (P exports from there), and D stitches it."""
    p, d = make_engine(), make_engine()
    first = GenerationRequest("a", SYSTEM + [50, 51], greedy(6))
    d.decode([(first, p.prefill([first])["a"].prefill)])
    follow = GenerationRequest("b", SYSTEM + [60, 61, 62, 63, 64], greedy(6))
    held = len(d.blocks.computed_prefix(d_seq(d, follow))) * d.blocks.block_size
    assert held == 40  # the system prompt's ten blocks, imported with the first request
    p.add_request(follow, Mode.PREFILL, kv_export_start=held)
    handoff = p.run_to_completion()["b"][0].prefill
    assert handoff.kv.meta.start == held and handoff.kv.data.shape[2] == len(follow.prompt_token_ids) - held
    hits_before = d.blocks.prefix_hits
    got = d.decode([(follow, handoff)])["b"].output_token_ids
    assert d.blocks.prefix_hits - hits_before == held
    assert got == make_engine().generate([follow])["b"].output_token_ids
    # A full export to a D that holds the start: D skips the part of the payload it has.
    # The log probabilities tell a KV row in the wrong place even where the argmax does not.
    full = GenerationRequest("f", SYSTEM + [60, 61, 62, 63, 65], SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0))
    hits_before = d.blocks.prefix_hits
    got = d.decode([(full, p.prefill([full])["f"].prefill)])["f"]
    assert d.blocks.prefix_hits - hits_before == 44
    want = make_engine().generate([full])["f"]
    assert got.output_token_ids == want.output_token_ids
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-9)
    assert_all_blocks_back(d)


def test_decode_refuses_a_partial_export_it_cannot_stitch():
    p, d = make_engine(), make_engine()
    request = GenerationRequest("c", SYSTEM + [1, 2, 3], greedy(4))
    p.add_request(request, Mode.PREFILL, kv_export_start=16)
    handoff = p.run_to_completion()["c"][0].prefill
    d.add_request(request, Mode.DECODE, handoff)  # D holds nothing of this prompt
    [out] = d.step()
    assert out.finished and out.finish_reason == "abort" and out.error.startswith("kv.start")
    assert_all_blocks_back(d)


def d_seq(engine: LLMEngine, request: GenerationRequest) -> Sequence:
    """A sequence as ``engine`` would key it, for a look-up only."""
    return Sequence(request, 1, 0, Mode.GENERATE, time.time() + 60, engine._kv_namespace)


def test_blocks_come_back_after_aborts_and_timeouts_with_forks():
    engine = make_engine(num_blocks=64)
    engine.add_request(GenerationRequest("aborted", SYSTEM + [7], sampled(30, seed=1), n=3))
    engine.add_request(GenerationRequest("expires", SYSTEM + [8], sampled(30, seed=2), n=2,
                                         deadline=time.time() + 3600))
    engine.add_request(GenerationRequest("runs", SYSTEM + [9], greedy(5), n=2))
    for _ in range(4):
        engine.step()
    assert engine.block_counts().held > 0
    assert len(engine.scheduler.running) == 7  # every choice forked
    shared = [b for b in range(engine.blocks.num_blocks) if engine.blocks.ref_count[b] > 1]
    assert shared, "the choices share their prompt's blocks"
    aborted = engine.abort("aborted")
    assert sorted(o.index for o in aborted) == [0, 1, 2] and all(o.finish_reason == "abort" for o in aborted)
    for seq in engine._choices("expires"):
        seq.deadline = 0
    expired = engine.step()
    assert sorted(o.index for o in expired if o.finish_reason == "timeout") == [0, 1]
    engine.run_to_completion()
    assert_all_blocks_back(engine)


def test_choices_that_never_forked_end_with_their_request():
    engine = make_engine()
    engine.add_request(GenerationRequest("early", SYSTEM * 2, sampled(5, seed=3), n=3))
    engine.step()  # 64 of 80 prompt tokens: not forked yet
    outs = engine.abort("early")
    assert sorted(o.index for o in outs) == [0, 1, 2] and all(o.finished for o in outs)
    assert_all_blocks_back(engine)


# ---- the block manager alone -----------------------------------------------------------


def seq_of(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(GenerationRequest(rid, tokens, greedy(4)), 1, 0, Mode.GENERATE, time.time() + 60, b"ns")


def fill(blocks: BlockManager, seq: Sequence, computed: list[int] = ()) -> None:
    """Allocate for the whole sequence as if one step computed it."""
    blocks.allocate(seq, seq.num_tokens, computed)
    seq.num_computed_tokens = seq.num_tokens
    blocks.cache_full_blocks(seq)


def test_fork_copies_the_shared_partial_block_on_write():
    blocks = BlockManager(num_blocks=8, block_size=4)
    parent = seq_of([1, 2, 3, 4, 5, 6])  # one full block, one partial
    fill(blocks, parent)
    child = parent.fork(PendingChoice(1, 2))
    blocks.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [blocks.ref_count[b] for b in parent.block_table] == [2, 2]
    child.token_ids.append(9)
    assert blocks.blocks_needed(child, 7) == 1  # the copy of the partial block
    copies = blocks.allocate(child, 7)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert blocks.ref_count[parent.block_table[1]] == 1
    parent.token_ids.append(8)
    assert blocks.allocate(parent, 7) == []  # the parent is alone on its block now: writes in place
    blocks.free(child)
    blocks.free(parent)
    assert blocks.counts().held == 0 and not any(blocks.ref_count)


def test_cached_blocks_are_reused_then_evicted_oldest_first():
    blocks = BlockManager(num_blocks=6, block_size=4)
    a = seq_of(list(range(1, 10)), "a")  # 2 full blocks + 1
    fill(blocks, a)
    blocks.free(a)
    assert blocks.counts().cached == 2 and blocks.counts().held == 0
    b = seq_of(list(range(1, 9)) + [99], "b")
    hits = blocks.computed_prefix(b)
    assert len(hits) == 2
    fill(blocks, b, hits)
    assert b.block_table[:2] == hits
    blocks.free(b)  # a's two blocks cached again, b's end free
    x = seq_of(list(range(100, 109)), "x")
    fill(blocks, x)
    blocks.free(x)  # cached, oldest first: a's 2nd block, a's 1st (a request's end before its start), x's 2nd, x's 1st

    def cached_blocks(tokens: list[int]) -> int:
        return len(blocks.computed_prefix(seq_of(tokens + [5], "probe")))

    assert blocks.counts().cached == 4 and blocks.counts().free == 2
    # Three blocks: the two free ones, then one eviction, the oldest freed: a's second block.
    y = seq_of(list(range(200, 211)), "y")
    fill(blocks, y)
    assert (cached_blocks(list(range(1, 9))), cached_blocks(list(range(100, 108)))) == (1, 2)
    blocks.free(y)
    # Three more: y's end is free, then a's first block and x's second go; x's first stays.
    z = seq_of(list(range(300, 311)), "z")
    fill(blocks, z)
    assert (cached_blocks(list(range(1, 9))), cached_blocks(list(range(100, 108)))) == (0, 1)
    assert cached_blocks(list(range(200, 208))) == 2  # y's, freed after x's: still there
    blocks.free(z)
    # A sequence needing every block evicts every cached one.
    c = seq_of(list(range(400, 424)), "c")
    fill(blocks, c)
    assert blocks.counts().cached == 0 and blocks.counts().held == 6
    assert cached_blocks(list(range(200, 208))) == 0
    blocks.free(c)
    assert blocks.counts().held == 0


def test_the_last_token_is_never_a_hit():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(1, 9)), "a")  # exactly two full blocks
    fill(blocks, a)
    blocks.free(a)
    again = seq_of(list(range(1, 9)), "again")
    assert len(blocks.computed_prefix(again)) == 1  # the block of the last token is computed again


def test_namespace_separates_models():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(1, 10)))
    fill(blocks, a)
    blocks.free(a)
    other = Sequence(GenerationRequest("o", list(range(1, 10)), greedy(4)), 1, 0, Mode.GENERATE,
                     time.time() + 60, b"another-model")
    assert blocks.computed_prefix(other) == []


def test_a_block_whose_key_another_holds_is_keyed_once_that_one_is_evicted():
    blocks = BlockManager(num_blocks=4, block_size=4)
    first, twin = seq_of([1, 2, 3, 4, 5], "first"), seq_of([1, 2, 3, 4, 6], "twin")
    fill(blocks, first)
    fill(blocks, twin)  # the same first block, computed apart: its key stays with first's block
    assert blocks.block_key[twin.block_table[0]] is None
    blocks.free(first)
    blocks.allocate(seq_of(list(range(20, 28)), "evicts"), 8)  # takes the free block, then evicts first's
    twin.token_ids.append(7)
    blocks.allocate(twin, 6)
    twin.num_computed_tokens = 6
    blocks.cache_full_blocks(twin)  # a later step: twin's block now carries the key
    assert blocks.computed_prefix(seq_of([1, 2, 3, 4, 9], "probe")) == [twin.block_table[0]]


def test_a_block_left_unkeyed_is_looked_at_again_only_once_a_key_is_dropped_or_a_block_fills():
    """The decode steps' commit looks at a sequence whose block another's key left unkeyed only when
    that look can key something: after some key is given up, or when a block fills."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    first, twin = seq_of([1, 2, 3, 4, 5], "first"), seq_of([1, 2, 3, 4, 6], "twin")
    fill(blocks, first)
    fill(blocks, twin)
    looks = []
    hashes = blocks.block_hashes
    blocks.block_hashes = lambda seq, n: looks.append((seq.request_id, n)) or hashes(seq, n)

    def decode(seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        blocks.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        blocks.cache_filled_blocks([seq])

    decode(twin, 7)
    assert looks == [] and blocks.block_key[twin.block_table[0]] is None
    other = seq_of([50, 51, 52, 53, 54], "other")
    fill(blocks, other)
    blocks.free(other)  # its full block cached, its tail free
    looks.clear()
    evicts = seq_of(list(range(20, 36)), "evicts")
    blocks.allocate(evicts, 16)  # the three free blocks, then other's: its key is dropped
    blocks.free(evicts)
    decode(twin, 8)  # a look: twin's block still unkeyed (first's holds the key)
    assert looks == [("twin", 1)] and blocks.block_key[twin.block_table[0]] is None
    decode(twin, 9)  # twin fills its second block: a look, which keys that one
    assert looks == [("twin", 1), ("twin", 2)] and blocks.block_key[twin.block_table[1]] is not None
    looks.clear()
    decode(twin, 10)
    blocks.reset_prefix_cache()  # nothing cached: no key dropped
    decode(twin, 11)
    assert looks == []
    blocks.free(first)  # first's block cached: dropping its key lets twin's block take it
    assert blocks.reset_prefix_cache() == 1
    decode(twin, 12)
    assert looks == [("twin", 2)] and blocks.block_key[twin.block_table[0]] is not None
