"""Coalesced streaming (engine/async_engine.py): a reader that is behind takes every output made
since it last took, as one batch, and the outputs are the engine's own, one per step per choice,
in order: the same tokens, text, logprobs and counts as a reader that keeps up."""

import asyncio
from dataclasses import asdict

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import STOP
from engine.request import GenerationRequest
from sampling import SamplingParams

CONFIG = dict(model="tiny-llama", block_size=4, dtype="float32")  # exact equality: float32 (docs/testing.md)
PROMPT = list(range(7, 40))
FIELDS = ("request_id", "index", "new_token_ids", "new_text", "num_output_tokens", "finished", "finish_reason",
          "seed", "logprobs", "cumulative_logprob", "output_token_ids", "text")


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine(EngineConfig(**CONFIG))
    yield engine
    engine.shutdown()


def params(**overrides) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 24, "temperature": 0.8, "top_k": 40, "seed": 7, "logprobs": 2,
                             "ignore_eos": True, **overrides})


def steps(request: GenerationRequest) -> list[dict]:
    """The engine's outputs for ``request``, step by step, in this process (no asyncio)."""
    engine = LLMEngine(EngineConfig(**CONFIG))
    engine.add_request(request)
    return [view(o) for o in engine.run_to_completion()[request.request_id]]


def view(output) -> dict:
    return {name: value for name, value in asdict(output).items() if name in FIELDS}


def a_stop_string() -> str:
    """Three characters from the middle of choice 0's text: its stop is met well after its start."""
    final = [s for s in steps(GenerationRequest("probe", PROMPT, params(), n=2)) if s["finished"]]
    text = next(s["text"] for s in final if s["index"] == 0)
    assert len(text) > 12, text
    return text[len(text) // 2: len(text) // 2 + 3]


async def finished_count(engine: AsyncEngine) -> int:
    return sum(engine.stats().finished_by_reason.values())


async def read_behind(engine: AsyncEngine, request: GenerationRequest) -> list[list]:
    """Take one batch, then nothing until the engine has ended the request, then the rest."""
    done_before = await finished_count(engine)
    batches = engine.generate_batches(request)
    taken = [await anext(batches)]
    for _ in range(3000):  # bounded: the engine ends a 24-token request in a few hundred ms
        if await finished_count(engine) >= done_before + request.n:
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail(f"{request.request_id} did not end within 60 s")
    # The last outputs are delivered just after the count moves: a request after it ends later,
    # so once its stream is over, every output of ``request`` waits in its outbox.
    barrier = GenerationRequest(f"{request.request_id}-barrier", [3, 4], params(max_new_tokens=1))
    assert [o async for o in engine.generate(barrier)][-1].finished
    taken += [batch async for batch in batches]
    return taken


def test_a_reader_behind_gets_one_batch_with_every_step_exactly_as_made(async_engine):
    stop = a_stop_string()
    request = GenerationRequest("behind", PROMPT, params(stop=[stop]), n=2)
    expected = steps(request)
    batches = asyncio.run(read_behind(async_engine, request))
    assert len(batches) == 2  # the first take, then all the rest in one wake-up
    assert [view(o) for batch in batches for o in batch] == expected
    # The stop string ends choice 0 inside the coalesced batch, after other tokens of it.
    rest = [o for o in batches[1] if o.index == 0]
    assert len(rest) > 2 and rest[-1].finished and rest[-1].finish_reason == STOP
    assert stop not in rest[-1].text and rest[-1].text == "".join(
        o.new_text for batch in batches for o in batch if o.index == 0)
    assert all(len(o.logprobs) == len(o.new_token_ids) for batch in batches for o in batch)


def test_a_reader_that_keeps_up_gets_the_same_outputs(async_engine):
    request = GenerationRequest("kept-up", PROMPT, params(), n=2)

    async def read():
        return [batch async for batch in async_engine.generate_batches(request)]

    batches = asyncio.run(read())
    assert all(batches)  # never an empty batch
    assert [view(o) for batch in batches for o in batch] == steps(request)
