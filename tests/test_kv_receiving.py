"""D's side of the hand-off: a request whose KV has not arrived is admitted with blocks for it,
asks for the bytes only then (so a D without room pulls nothing), and runs once they are there;
ending it while it waits frees its blocks."""

from dataclasses import replace
import time

import pytest

from engine.config import EngineConfig
from engine.kv_transfer import KVPayload
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode
from sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [3 + i for i in range(20)], "b": [400 + i for i in range(20)]}


def engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, **overrides))


@pytest.fixture(scope="module")
def handoffs(model_dirs):
    """P's results for both requests, and the tokens a colocated run gives."""
    p = engine(model_dirs["llama"])
    requests = [GenerationRequest(rid, prompt, PARAMS) for rid, prompt in PROMPTS.items()]
    results = {rid: out.prefill for rid, out in p.prefill(requests).items()}
    expected = {rid: out.output_token_ids for rid, out in engine(model_dirs["llama"]).generate(
        [GenerationRequest(rid, prompt, PARAMS) for rid, prompt in PROMPTS.items()]).items()}
    return results, expected


def without_bytes(result):
    return replace(result, kv=KVPayload(result.kv.meta, None))


def test_a_decode_without_room_does_not_ask_for_the_kv_until_it_has_room(model_dirs, handoffs):
    results, expected = handoffs
    d = engine(model_dirs["llama"], num_blocks=8)  # 32 tokens: one request of 20 + 8 at a time
    for rid, prompt in PROMPTS.items():
        d.add_request(GenerationRequest(rid, prompt, PARAMS), Mode.DECODE, without_bytes(results[rid]))
    assert d.step() == [] and d.take_kv_wanted() == ["a"]  # b waits in the queue, and pulls nothing
    assert [s.request_id for s in d.scheduler.receiving] == ["a"] and d.blocks.counts().held == 6
    assert not d.has_work()  # nothing runs until the bytes arrive
    assert d.receive_kv("a", results["a"].kv.data)
    outputs = {}
    while d.has_work():
        for out in d.step():
            outputs[out.request_id] = out
        for rid in d.take_kv_wanted():  # b, once a has ended and left it the room
            assert rid == "b" and outputs["a"].finished
            assert d.receive_kv(rid, results[rid].kv.data)
    assert {rid: out.output_token_ids for rid, out in outputs.items()} == expected
    assert d.blocks.counts().held == 0


def test_ending_a_request_while_it_waits_for_its_kv_frees_its_blocks(model_dirs, handoffs):
    results, _ = handoffs
    d = engine(model_dirs["llama"])
    d.add_request(GenerationRequest("a", PROMPTS["a"], PARAMS), Mode.DECODE, without_bytes(results["a"]))
    d.step()
    assert d.take_kv_wanted() == ["a"] and d.blocks.counts().held > 0
    (ended,) = d.abort("a")
    assert ended.finished and ended.finish_reason == "abort" and d.blocks.counts().held == 0
    assert not d.receive_kv("a", results["a"].kv.data)  # bytes that come late are dropped
    request = GenerationRequest("late", PROMPTS["a"], PARAMS, deadline=time.time() + 60)
    d.add_request(request, Mode.DECODE, without_bytes(results["a"]))
    d.step()
    d.scheduler.receiving[0].deadline = 0.0  # its deadline passes while it waits
    (expired,) = d.step()
    assert expired.finish_reason == "timeout" and d.blocks.counts().held == 0 and not d.scheduler.receiving

