"""The prefix store's rules, model-free (engine/prefix_store.py): publish, look up, pull, evict,
reference counts while a pull is in flight, the fail-closed rule for a half-published block, and
keys that the model, a LoRA adapter or a prompt table changes."""

import time

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.lora_adapter import LoraAdapter
from engine.prefix_store import PrefixStore, StoreRefused
from engine.request import GenerationRequest, Mode, PromptTable, Sequence
from sampling import SamplingParams

BLOCK = 100  # bytes per block in these tests


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def published(store: PrefixStore, *names: str) -> list[bytes]:
    chain = keys(*names)
    reserved = store.begin_publish(chain, BLOCK)
    store.complete_publish({key: f"bytes of {key.decode()}" for key in reserved})
    return chain


def test_a_published_chain_is_found_and_pulled_in_order():
    store = PrefixStore(capacity_bytes=10 * BLOCK)
    published(store, "a", "b", "c")
    assert store.longest_chain(keys("a", "b", "c", "d")) == 3
    assert store.longest_chain(keys("a", "x", "c")) == 1  # a chain stops at the first block not stored
    assert store.longest_chain(keys("x", "b")) == 0
    pull = store.pull(keys("a", "b"))
    assert pull.handles == ["bytes of a", "bytes of b"]
    store.end_pull(pull.pull_id)
    counters = store.counters()
    assert (counters["published"], counters["lookups"], counters["hits"], counters["hit_blocks"]) == (3, 3, 2, 4)
    assert (counters["pulls"], counters["pulled_blocks"], counters["pulls_in_flight"]) == (1, 2, 0)
    assert (counters["bytes"], counters["blocks"]) == (3 * BLOCK, 3)


def test_a_block_is_published_once():
    store = PrefixStore(capacity_bytes=10 * BLOCK)
    published(store, "a", "b")
    assert store.begin_publish(keys("a", "b", "c"), BLOCK) == keys("c")
    assert store.counters()["bytes"] == 3 * BLOCK


def test_a_half_published_block_is_never_served():
    store = PrefixStore(capacity_bytes=10 * BLOCK)
    published(store, "a")
    pending = store.begin_publish(keys("b", "c"), BLOCK)
    store.complete_publish({b"c": "bytes of c"})  # b's bytes never arrived
    assert store.longest_chain(keys("a", "b", "c")) == 1
    with pytest.raises(StoreRefused, match="being published"):
        store.pull(keys("a", "b"))
    assert store.counters()["pulls_in_flight"] == 0  # a refused pull holds nothing
    store.abort_publish(pending)  # the publisher gave up: b is dropped, c (complete) stays
    assert not store.served(b"b") and store.served(b"c")
    with pytest.raises(StoreRefused, match="not in the store"):
        store.pull(keys("b"))
    store.complete_publish({b"b": "late bytes"})  # a completion after the abort serves nothing
    assert not store.served(b"b")


def test_least_recently_used_blocks_are_evicted_to_stay_in_bytes():
    store = PrefixStore(capacity_bytes=3 * BLOCK)
    published(store, "a", "b", "c")
    store.longest_chain(keys("a"))  # a is now the newest: b goes first
    published(store, "d")
    assert [store.served(k) for k in keys("a", "b", "c", "d")] == [True, False, True, True]
    published(store, "e", "f")
    assert [store.served(k) for k in keys("a", "c", "d", "e", "f")] == [False, False, True, True, True]
    counters = store.counters()
    assert (counters["evictions"], counters["bytes"], counters["blocks"]) == (3, 3 * BLOCK, 3)


def test_a_block_evicted_while_pulled_stays_until_its_pull_ends():
    store = PrefixStore(capacity_bytes=2 * BLOCK)
    published(store, "a", "b")
    pull = store.pull(keys("a", "b"))
    published(store, "c", "d")  # evicts a and b, which the pull still reads
    assert not store.served(b"a") and not store.served(b"b")
    assert store.longest_chain(keys("a")) == 0  # no longer found ...
    assert {"bytes of a", "bytes of b"} <= set(store.handles_held())  # ... but kept for the reader
    assert (store.counters()["bytes"], store.counters()["kept_for_pulls"]) == (2 * BLOCK, 2 * BLOCK)
    store.end_pull(pull.pull_id)
    assert set(store.handles_held()) == {"bytes of c", "bytes of d"}
    assert (store.counters()["bytes"], store.counters()["kept_for_pulls"]) == (2 * BLOCK, 0)


def test_a_block_evicted_and_published_again_keeps_each_pulls_count():
    store = PrefixStore(capacity_bytes=BLOCK)
    published(store, "a")
    first = store.pull(keys("a"))
    published(store, "b")  # evicts a (pulled)
    published(store, "a")  # a again, new bytes; evicts b
    second = store.pull(keys("a"))
    store.end_pull(first.pull_id)  # ends the old a's pull only
    assert store.served(b"a") and store.counters()["kept_for_pulls"] == 0
    store.end_pull(second.pull_id)
    published(store, "c")  # the new a, no longer pulled, is evicted at once
    assert store.handles_held() == ["bytes of c"]


def test_a_pulled_block_is_not_evicted_before_an_unpulled_newer_one_is():
    store = PrefixStore(capacity_bytes=2 * BLOCK)
    published(store, "a", "b")
    pull = store.pull(keys("a"))  # a pull makes a the newest
    published(store, "c")
    assert store.served(b"a") and not store.served(b"b")
    store.end_pull(pull.pull_id)


def test_a_block_larger_than_the_store_is_refused():
    store = PrefixStore(capacity_bytes=BLOCK)
    assert store.begin_publish(keys("a"), BLOCK + 1) == []
    with pytest.raises(ValueError, match="capacity_bytes"):
        PrefixStore(0)


# ---- the keys: the prefix cache's own (engine/block_manager.py's chain_hash) ----------


def prompt_keys(namespace: bytes, tokens: list[int], lora: LoraAdapter | None = None,
                table: PromptTable | None = None) -> list[bytes]:
    request = GenerationRequest("r", tokens, SamplingParams(max_new_tokens=1), prompt_table=table)
    seq = Sequence(request, 1, 0, Mode.PREFILL, time.time() + 60, namespace, 0, lora)
    return BlockManager(num_blocks=8, block_size=4).block_hashes(seq, len(tokens) // 4)


def test_keys_differ_with_the_model_the_adapter_and_the_prompt_table():
    tokens = list(range(1, 13))
    adapter = LoraAdapter.of("sql", {(0, "q"): (np.ones((2, 8), np.float32), np.ones((8, 2), np.float32))})
    other_adapter = LoraAdapter.of("sql", {(0, "q"): (np.ones((2, 8), np.float32), np.zeros((8, 2), np.float32))})
    table = PromptTable.of(np.ones((3, 8), np.float32))
    variants = {
        "base": prompt_keys(b"model:float32", tokens),
        "other model": prompt_keys(b"other:float32", tokens),
        "other dtype": prompt_keys(b"model:bfloat16", tokens),
        "lora": prompt_keys(b"model:float32", tokens, adapter),
        "same name, other weights": prompt_keys(b"model:float32", tokens, other_adapter),
        "prompt table": prompt_keys(b"model:float32", tokens, table=table),
    }
    assert prompt_keys(b"model:float32", tokens) == variants["base"]  # the same in every process
    firsts = [chain[0] for chain in variants.values()]
    assert len(set(firsts)) == len(firsts)
    store = PrefixStore(capacity_bytes=100 * BLOCK)
    reserved = store.begin_publish(variants["base"], BLOCK)
    store.complete_publish({key: "kv" for key in reserved})
    assert store.longest_chain(variants["base"]) == 3
    for name, chain in variants.items():
        if name != "base":
            assert store.longest_chain(chain) == 0, name
    # A prompt that shares the first two blocks finds exactly those.
    assert store.longest_chain(prompt_keys(b"model:float32", tokens[:8] + [99, 98, 97, 96])) == 2


# ---- routing: "in the store" below "in my pool", above nothing (deployments/pd/routing.py) ----


def test_the_router_counts_the_store_below_the_pool_and_above_nothing():
    from deployments.pd.routing import AFFINITY_BLOCK, PREFILL_IMBALANCE_TOKENS, load, rank, set_prefix_store
    from tests.test_pd_prefix import fake_replica

    prompt = list(range(3, 3 + 8 * AFFINITY_BLOCK))
    longer = GenerationRequest("t2", prompt + [9] * AFFINITY_BLOCK, SamplingParams(max_new_tokens=1))
    for deployment, store_on in (("test-store-on", True), ("test-store-off", False)):
        if store_on:
            set_prefix_store(deployment)
        first = fake_replica(f"{deployment}-1", queued_prompt_tokens=0)
        rank(deployment, GenerationRequest("t", prompt, SamplingParams(max_new_tokens=1)), [first], prefill=True)
        # In my pool before in the store: the replica sent the prefix comes first at equal load.
        sent, fresh = (fake_replica(f"{deployment}-{i}", queued_prompt_tokens=0) for i in (1, 2))
        assert rank(deployment, longer, [fresh, sent], prefill=True)[0] is sent
        # Loads too far apart: the fresh replica, which computes only what the store lacks (store on).
        busy = fake_replica(f"{deployment}-1", queued_prompt_tokens=PREFILL_IMBALANCE_TOKENS + 10_000)
        other = fake_replica(f"{deployment}-3", queued_prompt_tokens=0)
        longest = GenerationRequest("t3", longer.prompt_token_ids + [8] * AFFINITY_BLOCK,
                                    SamplingParams(max_new_tokens=1))
        assert rank(deployment, longest, [busy, other], prefill=True)[0] is other
        expected = AFFINITY_BLOCK if store_on else len(longest.prompt_token_ids)
        assert load(other, prefill=True, now=time.monotonic()) == expected


def test_prefill_affinity_off_routes_by_load_alone():
    from deployments.pd.routing import AFFINITY_BLOCK, rank, set_affinity_off
    from tests.test_pd_prefix import fake_replica

    prompt = GenerationRequest("t", list(range(3, 3 + 4 * AFFINITY_BLOCK)), SamplingParams(max_new_tokens=1))
    for deployment, affinity in (("test-affinity-on", True), ("test-affinity-off", False)):
        if not affinity:
            set_affinity_off(deployment)
        sent = fake_replica(f"{deployment}-1", queued_prompt_tokens=0)
        rank(deployment, prompt, [sent], prefill=True)
        sent_later = fake_replica(f"{deployment}-1", queued_prompt_tokens=100)  # within the imbalance bound
        idle = fake_replica(f"{deployment}-2", queued_prompt_tokens=0)
        assert rank(deployment, prompt, [sent_later, idle], prefill=True)[0] is (sent_later if affinity else idle)
