"""The engine's side of the prefix store, in process: KV blocks one engine computed, imported into
another engine's pool (LLMEngine.import_prefix), are prefix hits there; its prompt computes only the
rest, and its tokens and exported KV equal those of an engine that computed the whole prompt."""

import time

import numpy as np

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode
from sampling import SamplingParams

SYSTEM = list(range(3, 43))  # ten blocks of 4


def make_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", block_size=4, max_num_batched_tokens=64))


def request(rid: str, tail: list[int]) -> GenerationRequest:
    return GenerationRequest(rid, SYSTEM + tail, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True,
                                                                logprobs=0))


def test_blocks_imported_from_another_engine_are_hits_and_give_the_same_tokens():
    first, second = make_engine(), make_engine()
    computed = first.prefill([request("a", [50, 51])])["a"].prefill
    keys = first.prefix_keys(request("a", [50, 51]))
    assert keys == second.prefix_keys(request("a", [50, 51]))  # content keys: the same in every engine
    published = keys[:10]  # the system prompt's blocks; [L, 2, 40, H, D] of the prefill's export
    data = computed.kv.data[:, :, :40]

    follow = request("b", [60, 61, 62])
    follow_keys = second.prefix_keys(follow)
    assert follow_keys[:10] == published
    # The second engine already holds the first 3 blocks: only the other 7 are written.
    second.prefill([GenerationRequest("warm", SYSTEM[:13], SamplingParams(max_new_tokens=1))])
    assert len(second.blocks.chain_blocks(published)) == 3
    before = second.scheduler.num_prompt_tokens_computed
    assert second.import_prefix("b", published, 3, data[:, :, 12:], time.time() + 60) == 7
    second.add_request(follow, Mode.PREFILL)
    got = second.run_to_completion()["b"][0]
    assert second.scheduler.num_prompt_tokens_computed - before == len(follow.prompt_token_ids) - 40
    want = make_engine().prefill([follow])["b"]
    assert got.output_token_ids == want.output_token_ids
    np.testing.assert_array_equal(got.prefill.kv.data, want.prefill.kv.data)
    assert len(second.holds) == 0  # the hold ended with the request
    counts = second.block_counts()
    assert counts.held == 0


def test_an_import_whose_chain_the_pool_lost_writes_nothing_and_the_prompt_computes():
    engine = make_engine()
    keys = engine.prefix_keys(request("a", [50]))[:10]
    fake = np.zeros((1,), np.float32)  # never read: the pool lacks the first 3 blocks the import continues
    assert engine.import_prefix("a", keys, 3, fake, time.time() + 60) == 0
    assert engine.blocks.chain_blocks(keys) == []
    engine.add_request(request("a", [50]), Mode.PREFILL)
    engine.run_to_completion()
    assert engine.scheduler.num_prompt_tokens_computed == 41


def test_an_import_for_a_request_that_never_comes_is_dropped_at_its_time():
    first, second = make_engine(), make_engine()
    data = first.prefill([request("a", [50])])["a"].prefill.kv.data[:, :, :40]
    keys = first.prefix_keys(request("a", [50]))[:10]
    assert second.import_prefix("gone", keys, 0, data, time.time() - 1) == 10
    assert second.block_counts().held == 10
    second.step()  # expires the hold: the blocks stay cached, found by the next prompt
    counts = second.block_counts()
    assert (counts.held, counts.cached) == (0, 10)
    assert len(second.blocks.chain_blocks(keys)) == 10


# ---- a P replica's side (deployments/replicas/prefix_store.py's PrefixStoreClient), without Ray ----


class _Call:
    """A store method as a DeploymentHandle's: ``.remote(...)`` gives an awaitable of its answer."""

    def __init__(self, method) -> None:
        self.method = method

    def remote(self, *args):
        async def answer():
            return self.method(*args)

        return answer()


class LocalStore:
    """The store replica's answers (PrefixStoreServer's) with each block's bytes as an awaitable, not an ObjectRef."""

    def __init__(self) -> None:
        from engine.prefix_store import PrefixStore

        self.store, self.metas = PrefixStore(1 << 30), {}
        for name in ("longest_chain", "publish", "pull", "end_pull", "counters"):
            setattr(self, name, _Call(getattr(self, f"_{name}")))

    def _longest_chain(self, keys):
        return self.store.longest_chain(keys)

    def _publish(self, keys, meta, data):
        size = meta.num_tokens
        reserved = self.store.begin_publish(keys, data[:, :, :size].nbytes)
        handles = {key: np.array(data[:, :, i * size:(i + 1) * size]) for i, key in enumerate(keys) if key in reserved}
        self.metas.update(dict.fromkeys(handles, meta))
        return self.store.complete_publish(handles)

    def _pull(self, keys):
        async def ready(block):
            return block

        pull = self.store.pull(keys)
        return pull.pull_id, [[ready(block)] for block in pull.handles], [self.metas[key] for key in keys]

    def _end_pull(self, pull_id):
        self.store.end_pull(pull_id)

    def _counters(self):
        return self.store.counters()


def test_a_prefill_replica_pulls_what_another_published_and_refuses_blocks_of_another_layout():
    import asyncio
    from dataclasses import replace

    from deployments.replicas.prefix_store import PrefixStoreClient
    from engine.async_engine import AsyncEngine

    config = EngineConfig(model="tiny-llama", dtype="float32", block_size=4, max_num_batched_tokens=64)
    store = LocalStore()
    engines = [AsyncEngine(config) for _ in range(3)]

    async def prefill(engine, rid: str) -> tuple[list[int], int]:
        """(first token, prompt tokens computed) of the prompt through ``engine``, pulling and publishing."""
        client = PrefixStoreClient(store, engine)
        prompt = request(rid, [50, 51, 52])
        before = engine.engine.scheduler.num_prompt_tokens_computed
        keys, stored = await client.pull(prompt, None)
        outputs = await engine.prefill(prompt)
        client.publish(keys, stored, outputs[0].prefill.kv)
        await asyncio.gather(*client._tasks)
        return outputs[0].output_token_ids, engine.engine.scheduler.num_prompt_tokens_computed - before

    try:
        first, computed = asyncio.run(prefill(engines[0], "a"))
        assert computed == 43 and store.store.counters()["published"] == 10
        second, computed = asyncio.run(prefill(engines[1], "b"))
        assert (second, computed) == (first, 3)  # its ten full blocks came from the store
        # A block of another layout (here: another model's id) is never imported: the prompt is computed.
        store.metas = {key: replace(meta, model_id="another") for key, meta in store.metas.items()}
        third, computed = asyncio.run(prefill(engines[2], "c"))
        assert (third, computed) == (first, 43)
        assert store.store.counters()["pulls_in_flight"] == 0
    finally:
        for engine in engines:
            engine.shutdown()
