"""The second KV tier (engine/kv_tier.py): evicted blocks spill there, a prefix look-up that ends in
the pool goes on there, and a hit is copied back instead of computed. The ledger's rules model-free;
the engine in process (tiny-llama, fp32): exact tokens equal to a run without the tier and to a cold
run, prompt tokens computed and the counters as claimed."""

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_tier import KVTier
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode, PromptTable, Sequence
from sampling import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def tier(capacity_blocks: int, device: str = "cpu", directory: str | None = None) -> KVTier:
    shape = (2, 2, 8)  # [L, k/v, B*Hkv*D]: 32 float32 elements, 128 bytes a block
    return KVTier(capacity_blocks * 128, shape, torch.float32, torch.device(device), directory)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def sequence(tokens: list[int], namespace: bytes = b"m", lora=None, table: PromptTable | None = None) -> Sequence:
    request = GenerationRequest("r", tokens, GREEDY, prompt_table=table)
    return Sequence(request, 0, 0, Mode.GENERATE, 0.0, namespace, 0, lora)


# ---- the tier's ledger -------------------------------------------------------------------


def test_an_entry_is_found_only_once_written(tmp_path):
    t = tier(4, directory=str(tmp_path))
    slot = t.reserve(key(1))
    assert slot is not None and key(1) in t
    assert t.lookup(key(1)) is None  # half-written: never served
    t.written([key(1)])
    assert t.lookup(key(1)) == slot
    assert t.reserve(key(1)) is None  # here already: no second copy
    assert (t.counts.hits, t.counts.spills, t.counts.spilled_bytes) == (1, 1, 128)
    assert list(tmp_path.iterdir()) == []  # the mapped file is unlinked at once


def test_a_full_tier_gives_up_the_least_recently_used_entry():
    t = tier(3)
    for i in range(3):
        t.reserve(key(i))
        t.written([key(i)])
    t.lookup(key(0))  # 0 is now the most recent: 1 is the oldest
    slot_of_1 = t.lookup(key(1))
    t.lookup(key(0))
    t.lookup(key(2))  # order, oldest first: 1, 0, 2
    assert t.reserve(key(9)) == slot_of_1
    t.written([key(9)])
    assert t.lookup(key(1)) is None and all(t.lookup(key(i)) is not None for i in (0, 2, 9))
    assert t.counts.evictions == 1 and len(t) == 3


def test_entries_being_written_are_not_given_up():
    t = tier(2)
    t.reserve(key(0))
    t.reserve(key(1))
    assert t.reserve(key(2)) is None  # every entry is being written: this block is not spilled
    assert t.counts.evictions == 0


def test_a_tier_too_small_for_one_block_is_refused():
    with pytest.raises(ValueError, match="kv_tier_gb"):
        tier(0)


def test_the_cpu_tier_is_a_memory_mapped_file():
    assert tier(2).storage.is_shared()  # torch.from_file(shared=True): pages of the file


# ---- the block manager's hooks -------------------------------------------------------------


def fill(blocks: BlockManager, seq: Sequence) -> None:
    """``seq`` computes its tokens and ends: its full blocks stay cached."""
    blocks.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    blocks.cache_full_blocks(seq)
    blocks.free(seq)


def test_an_evicted_block_spills_and_a_lookup_copies_it_back():
    blocks = BlockManager(5, BLOCK, tier=tier(8))
    first = sequence(list(range(10, 23)))  # 13 tokens: 3 full blocks, and a partial one left free
    fill(blocks, first)
    assert len(blocks.computed_prefix(sequence(list(range(10, 23))))) == 3  # found: reused content
    fill(blocks, sequence(list(range(50, 63))))  # takes the 2 free blocks, then evicts 2 of first's
    spills = blocks.take_tier_moves()
    assert [m.spill for m in spills] == [True, True]
    evicted = {m.key for m in spills}
    assert evicted <= set(first.block_hashes)
    blocks.tier.written([m.key for m in spills])
    again = sequence(list(range(10, 23)))
    hits = blocks.computed_prefix(again)
    assert len(hits) == 3  # the one left in the pool, and two copied back
    loads = blocks.take_tier_moves()
    assert [m.key for m in loads if not m.spill] == [k for k in first.block_hashes if k in evicted]
    assert all(blocks.block_key[m.block] == m.key for m in loads if not m.spill)
    assert blocks.tier.counts.hits == 2
    assert blocks.counts().held == 0  # the look-up holds nothing once it returns


def test_a_lookup_does_not_evict_its_own_pool_hits_for_copy_backs():
    blocks = BlockManager(4, BLOCK, tier=tier(8))
    fill(blocks, sequence(list(range(10, 23))))  # 3 blocks cached (the last first to go), 1 free
    head = blocks.computed_prefix(sequence(list(range(10, 23))))
    assert len(head) == 3 and blocks.take_tier_moves() == []
    fill(blocks, sequence(list(range(70, 78))))  # 2 full blocks: the free one, and the third evicted
    blocks.tier.written([m.key for m in blocks.take_tier_moves()])
    # Now the pool is all cached, the first two of the prompt's blocks the oldest: copying the third
    # back must evict another block than them (one never found: not spilled).
    hits = blocks.computed_prefix(sequence(list(range(10, 23))))
    assert hits[:2] == head[:2] and len(set(hits)) == 3
    assert [m.spill for m in blocks.take_tier_moves()] == [False]


def test_a_block_never_found_is_not_spilled():
    blocks = BlockManager(4, BLOCK, tier=tier(8))
    fill(blocks, sequence(list(range(10, 23))))
    fill(blocks, sequence(list(range(50, 63))))  # evicts the first's 3 blocks, never looked up
    assert blocks.take_tier_moves() == [] and len(blocks.tier) == 0


def test_a_tier_entry_is_not_used_when_the_key_differs():
    blocks = BlockManager(4, BLOCK, tier=tier(8))
    tokens = list(range(10, 23))
    fill(blocks, sequence(tokens))
    blocks.computed_prefix(sequence(tokens))
    fill(blocks, sequence(list(range(50, 63))))  # every block of the first evicted and spilled
    blocks.tier.written([m.key for m in blocks.take_tier_moves()])
    adapter = SimpleNamespace(ref=SimpleNamespace(digest=b"adapter"))
    table = PromptTable.of(torch.zeros(2, 8).numpy())
    for other in (sequence(tokens, lora=adapter), sequence(tokens, table=table), sequence(tokens, namespace=b"n")):
        assert blocks.computed_prefix(other) == []
    assert blocks.tier.counts.hits == 0
    assert len(blocks.computed_prefix(sequence(tokens))) == 3


def test_reset_forgets_the_tier():
    blocks = BlockManager(4, BLOCK, tier=tier(8))
    fill(blocks, sequence(list(range(10, 23))))
    blocks.computed_prefix(sequence(list(range(10, 23))))
    fill(blocks, sequence(list(range(50, 63))))
    blocks.tier.written([m.key for m in blocks.take_tier_moves()])
    assert len(blocks.tier) == 3
    blocks.reset_prefix_cache()
    assert len(blocks.tier) == 0 and blocks.computed_prefix(sequence(list(range(10, 23)))) == []


# ---- the engine in process -------------------------------------------------------------------


def engine(tier_gb: float = 0.0) -> LLMEngine:
    # A pool of 24 blocks: four prompts of 9 blocks do not fit in it together.
    return LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", block_size=BLOCK, num_blocks=24,
                                  max_num_batched_tokens=64, kv_tier_gb=tier_gb))


PROMPTS = [[i * 7 + j for j in range(3, 39)] for i in range(1, 5)]  # 36 tokens each: 9 blocks


def run(e: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [e.generate([GenerationRequest(f"r{i}", p, params)])[f"r{i}"].output_token_ids
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=40,
                                                          ignore_eos=True, seed=7)], ids=["greedy", "seeded"])
def test_a_tier_hit_is_copied_back_with_the_same_tokens(params):
    with_tier, without = engine(0.001), engine()
    # The first two are found once in the pool, then evicted by the others, then asked for again.
    order = PROMPTS[:2] + PROMPTS + PROMPTS[:2]
    tokens = run(with_tier, order, params)
    assert tokens == run(without, order, params)
    cold = run(engine(), PROMPTS[:2], params)
    assert tokens[-2:] == cold
    counts = with_tier.blocks.tier.counts
    # 8 blocks of each returning prompt (the last token's block is always computed) come back
    assert counts.hits == counts.copy_backs == 16
    assert counts.copied_back_bytes == 16 * with_tier.blocks.tier.block_bytes
    assert counts.spills > 0 and counts.spilled_bytes == counts.spills * with_tier.blocks.tier.block_bytes
    computed_with, computed_without = (e.scheduler.num_prompt_tokens_computed for e in (with_tier, without))
    assert computed_without - computed_with == 16 * BLOCK
    # The counts reach the replica's stats (what /metrics shows as pdserve_kv_tier); none without a tier.
    snapshot = AsyncEngine._snapshot
    assert snapshot(SimpleNamespace(engine=with_tier, _finished={})).kv_tier == asdict(counts)
    assert snapshot(SimpleNamespace(engine=without, _finished={})).kv_tier == {}


def test_a_tier_entry_is_not_used_for_another_prompt_table():
    e = engine(0.001)
    run(e, PROMPTS[:1] + PROMPTS)  # the first prompt's blocks are in the tier now
    assert e.blocks.tier.lookup(e.blocks.block_hashes(sequence(PROMPTS[0], e._kv_namespace), 1)[0]) is not None
    vocab, hidden = e.vocab_size, e.loaded.spec.hidden_size
    table = PromptTable.of(torch.randn(2, hidden, generator=torch.Generator().manual_seed(0)).numpy() * 0.05)
    request = GenerationRequest("t", PROMPTS[0][:-2] + [vocab, vocab + 1], GREEDY, prompt_table=table)
    hits_before = e.blocks.tier.counts.hits
    with_table = e.generate([request])["t"].output_token_ids
    assert e.blocks.tier.counts.hits == hits_before
    assert with_table == engine().generate([request])["t"].output_token_ids


def test_the_tier_is_off_by_default():
    assert EngineConfig().kv_tier_gb == 0 and engine().blocks.tier is None
