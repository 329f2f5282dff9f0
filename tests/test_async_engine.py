"""The asyncio interface: streaming, concurrency, and aborts when a stream is left early."""

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine(EngineConfig(model="tiny-llama", block_size=4))
    yield engine
    engine.shutdown()


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_concurrent_streams_match_the_sync_engine(async_engine):
    prompts = {f"r{i}": list(range(3, 3 + 5 * (i + 1))) for i in range(6)}
    expected = LLMEngine(EngineConfig(model="tiny-llama")).generate(
        [GenerationRequest(rid, p, greedy(10)) for rid, p in prompts.items()])

    async def consume(rid, prompt):
        outs = [o async for o in async_engine.generate(GenerationRequest(rid, prompt, greedy(10)))]
        return rid, outs

    async def main():
        return dict(await asyncio.gather(*(consume(rid, p) for rid, p in prompts.items())))

    streams = asyncio.run(main())
    for rid, outs in streams.items():
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert sum((o.new_token_ids for o in outs), []) == expected[rid].output_token_ids
        assert "".join(o.new_text for o in outs) == expected[rid].text


def test_leaving_a_stream_aborts_the_request_and_frees_blocks(async_engine):
    aborted = async_engine.stats().finished_by_reason.get("abort", 0)

    async def main():
        stream = async_engine.generate(GenerationRequest("leaver", list(range(3, 40)), greedy(5000)))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):  # the engine thread handles the abort on its next turn
            if async_engine.stats().blocks_used == 0 and async_engine.stats().running == 0:
                return True
            await asyncio.sleep(0.02)
        return False

    assert asyncio.run(main())
    assert async_engine.stats().finished_by_reason["abort"] == aborted + 1


def test_bad_request_raises_in_the_caller(async_engine):
    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            async for _ in async_engine.generate(GenerationRequest("bad", [10**6], greedy(2))):
                pass
        # The engine still serves.
        return [o async for o in async_engine.generate(GenerationRequest("good", [5, 6], greedy(2)))]

    assert asyncio.run(main())[-1].num_output_tokens == 2


def test_the_engine_is_built_and_stepped_on_its_own_thread(monkeypatch):
    # One thread runs every torch call, the warm-up forward too: a second thread's OpenMP pool
    # makes libgomp's workers sleep between parallel regions (engine/async_engine.py's _run).
    threads = []

    class Recording(LLMEngine):
        def __init__(self, config):
            threads.append(threading.current_thread())
            super().__init__(config)

        def step(self):
            threads.append(threading.current_thread())
            return super().step()

    monkeypatch.setattr("engine.async_engine.LLMEngine", Recording)
    engine = AsyncEngine(EngineConfig(model="tiny-llama", block_size=4))

    async def run():
        return [o async for o in engine.generate(GenerationRequest("r", [3, 4, 5], greedy(3)))]

    try:
        assert asyncio.run(run())[-1].finished
    finally:
        engine.shutdown()
    assert len(threads) > 3 and {thread.name for thread in threads} == {"pdserve-engine"}
    assert threads[0] is not threading.current_thread() and len(set(threads)) == 1


def test_an_engine_that_fails_to_build_raises_in_the_caller():
    before = {thread for thread in threading.enumerate() if thread.name == "pdserve-engine"}
    with pytest.raises(ValueError, match="no-such-model"):
        AsyncEngine(EngineConfig(model="no-such-model"))
    assert {thread for thread in threading.enumerate() if thread.name == "pdserve-engine"} == before
