"""Batch lines yield (issue 56): a background request (``GenerationRequest.background``, the Batch
API's lines) runs only in steps no foreground request is in. While one waits or runs, a background
request is not admitted and a running one is held (its KV kept, no tokens); once none is left the
held ones run on where they stopped, and end with the tokens of an undisturbed run. The scheduler
is driven alone (no model) where the order is the question, the engine where the tokens are."""

import asyncio
from dataclasses import replace
import json
from types import SimpleNamespace

import numpy as np
import pytest

from deployments.config import AppArgs
from deployments.ingress.batch_service import engines_waiting, in_process_sender
from engine.async_engine import AsyncEngine
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_transfer import KVMeta, KVPayload
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode, SequenceStatus
from engine.scheduler import Scheduler
from tests.inprocess_app import InProcessApp
from tests.test_scheduler_priority import greedy, sequence, step


def test_background_rows_are_held_while_a_foreground_request_waits_prefills_or_decodes():
    scheduler = Scheduler(BlockManager(num_blocks=200, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    lines = [sequence(f"line-{i}", 1, i, 8, background=True) for i in range(2)]
    for line in lines:
        scheduler.add(line)
    assert step(scheduler) == [("line-0", 8), ("line-1", 8)]
    assert step(scheduler) == [("line-0", 1), ("line-1", 1)]  # decoding: no foreground request here
    held_blocks = [list(line.block_table) for line in lines]
    # A foreground request of the lowest priority still has the step to itself: background is a
    # class below every priority.
    scheduler.add(sequence("chat", 5, 2, 12))
    assert step(scheduler) == [("chat", 12)]
    for _ in range(3):
        assert step(scheduler) == [("chat", 1)]
    # Held, not preempted: still running, their KV and progress kept.
    assert [line.status for line in lines] == [SequenceStatus.RUNNING] * 2
    assert [line.block_table for line in lines] == held_blocks
    assert [line.num_computed_tokens for line in lines] == [9, 9] and scheduler.num_preemptions == 0
    scheduler.remove(scheduler.running[-1])  # the foreground request ends
    assert step(scheduler) == [("line-0", 1), ("line-1", 1)]  # on from where they stopped


def test_a_background_request_waits_to_be_admitted_while_a_foreground_one_runs():
    scheduler = Scheduler(BlockManager(num_blocks=200, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    chat = sequence("chat", 5, 0, 8)
    scheduler.add(chat)
    assert step(scheduler) == [("chat", 8)]
    scheduler.add(sequence("line", 5, 1, 8, background=True))
    for _ in range(4):
        assert step(scheduler) == [("chat", 1)]
    assert [s.request_id for s in scheduler.waiting] == ["line"]
    scheduler.remove(chat)
    assert step(scheduler) == [("line", 8)]


def test_foreground_requests_keep_their_priority_order_beside_held_background_rows():
    scheduler = Scheduler(BlockManager(num_blocks=200, block_size=4), max_num_seqs=8, max_num_batched_tokens=16)
    scheduler.add(sequence("line", 5, 0, 8, background=True))
    step(scheduler)
    scheduler.add(sequence("p5", 5, 1, 24))
    scheduler.add(sequence("p1", 1, 2, 24))
    assert step(scheduler) == [("p1", 16)]
    assert step(scheduler) == [("p1", 8), ("p5", 8)]
    assert step(scheduler) == [("p1", 1), ("p5", 15)]


def test_a_full_pool_of_held_background_rows_is_preempted_for_a_waiting_foreground_request():
    """Without it the foreground request would wait for blocks the held rows never give back."""
    scheduler = Scheduler(BlockManager(num_blocks=6, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(2):
        scheduler.add(sequence(f"line-{i}", 5, i, 12, background=True))
    assert step(scheduler) == [("line-0", 12), ("line-1", 12)]  # every block held
    scheduler.add(sequence("chat", 5, 2, 8))
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.preempted] == ["line-1"]  # the latest background row
    assert [(s.request_id, n) for s, n in batch.entries] == [("chat", 8)]


def test_held_background_rows_run_to_their_end_once_foreground_traffic_stops():
    scheduler = Scheduler(BlockManager(num_blocks=200, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    line = sequence("line", 5, 0, 8, background=True)
    scheduler.add(line)
    step(scheduler)
    chats = [sequence(f"chat-{i}", 5, 1 + i, 8) for i in range(3)]
    for chat in chats:  # foreground requests one after the other: the line is held through all of them
        scheduler.add(chat)
        for _ in range(3):
            assert "line" not in dict(step(scheduler))
        scheduler.remove(chat)
    while line.num_output_tokens < 20:
        assert step(scheduler) == [("line", 1)]
    assert scheduler.num_preemptions == 0


def test_a_background_request_on_decode_fetches_beside_foreground_work_and_is_held_preemptible_once_here():
    """D in PD, the scheduler alone: the line is admitted into receiving (its KV fetched within P's
    lease) while a foreground request runs; once its KV is here it waits outside the running batch,
    its import not run, until no foreground request is left, and a foreground request short of blocks
    takes them from it."""
    scheduler = Scheduler(BlockManager(num_blocks=10, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    chat = sequence("chat", 5, 0, 8)
    scheduler.add(chat)
    step(scheduler)
    line = sequence("line", 5, 1, 16, background=True)
    line.mode = Mode.DECODE
    line.token_ids.append(7)  # P's first token
    meta = KVMeta("m", "float32", 1, 1, 4, num_tokens=16)
    line.pending_kv = KVPayload(meta, None)
    scheduler.add(line)
    batch = scheduler.schedule()
    scheduler.commit(batch)
    chat.token_ids.append(9)
    assert batch.kv_wanted == [line] and [(s.request_id, n) for s, n in batch.entries] == [("chat", 1)]
    line.pending_kv = KVPayload(meta, np.zeros((1, 2, 16, 1, 4), dtype=np.float32))
    scheduler.kv_arrived(line)
    batch = scheduler.schedule()
    scheduler.commit(batch)
    chat.token_ids.append(9)
    assert [(s.request_id, n) for s, n in batch.entries] == [("chat", 1)] and batch.kv_imports == []
    assert line not in scheduler.running and line.block_table  # held with its blocks, not in a row
    scheduler.add(sequence("long", 5, 2, 16))  # 4 blocks; 3 are free
    batch = scheduler.schedule()
    assert batch.preempted == [line] and [s.request_id for s in scheduler.waiting] == ["line"]
    assert ("long", 16) in [(s.request_id, n) for s, n in batch.entries]


@pytest.mark.slow
def test_background_and_foreground_requests_end_with_the_tokens_of_undisturbed_runs():
    """float32 greedy: requests held and run on give the tokens each gives alone."""
    config = EngineConfig(model="tiny-llama", dtype="float32", block_size=4, max_num_batched_tokens=64)
    prompts = {f"line-{i}": list(range(10 + 7 * i, 30 + 7 * i)) for i in range(3)}
    prompts["chat"] = list(range(300, 318))
    alone = {rid: LLMEngine(config).generate([GenerationRequest(rid, p, greedy(12))])[rid].output_token_ids
             for rid, p in prompts.items()}

    engine = LLMEngine(config)
    for i in range(3):
        engine.add_request(GenerationRequest(f"line-{i}", prompts[f"line-{i}"], greedy(12), background=True))
    outputs: dict[str, list] = {rid: [] for rid in prompts}

    def run_step() -> set[str]:
        out = engine.step()
        for o in out:
            outputs[o.request_id].append(o)
        return {o.request_id for o in out}

    for _ in range(4):
        run_step()
    engine.add_request(GenerationRequest("chat", prompts["chat"], greedy(12)))
    while not (outputs["chat"] and outputs["chat"][-1].finished):
        assert run_step() <= {"chat"}  # no line makes a token while the chat request is here
    while engine.has_work():
        run_step()
    assert {rid: outs[-1].output_token_ids for rid, outs in outputs.items()} == alone
    assert all(outs[-1].finished for outs in outputs.values())
    assert engine.blocks.counts().held == 0


@pytest.mark.slow
def test_a_held_background_request_on_decode_fetches_its_kv_and_imports_it_once_it_runs(model_dirs):
    """D in PD: a batch line whose KV is at P is admitted into receiving beside a running foreground
    request (P's copy is taken within its lease), then held with its KV here until the foreground
    one ends; both end with a colocated run's tokens."""
    config = EngineConfig(model=str(model_dirs["llama"]), dtype="float32", block_size=4)
    params = greedy(8)
    prompts = {"chat": [3 + i for i in range(20)], "line": [400 + i for i in range(20)]}
    requests = {rid: GenerationRequest(rid, prompt, params, background=rid == "line") for rid, prompt in prompts.items()}
    results = {rid: out.prefill for rid, out in LLMEngine(config).prefill(list(requests.values())).items()}
    expected = {rid: out.output_token_ids for rid, out in LLMEngine(config).generate(
        [GenerationRequest(rid, prompt, params) for rid, prompt in prompts.items()]).items()}

    d = LLMEngine(config)
    outputs: dict[str, list] = {rid: [] for rid in prompts}
    d.add_request(requests["chat"], Mode.DECODE, results["chat"])
    outputs["chat"] += d.step()
    d.add_request(requests["line"], Mode.DECODE, replace(results["line"], kv=KVPayload(results["line"].kv.meta, None)))
    outputs["chat"] += d.step()
    assert d.take_kv_wanted() == ["line"]  # admitted into receiving while the chat request runs
    assert d.receive_kv("line", results["line"].kv.data)
    while not outputs["chat"][-1].finished:
        for out in d.step():
            assert out.request_id == "chat"  # the line is held, its KV not imported yet
            outputs["chat"].append(out)
    while d.has_work():
        for out in d.step():
            outputs[out.request_id].append(out)
    assert {rid: outs[-1].output_token_ids for rid, outs in outputs.items()} == expected
    assert d.blocks.counts().held == 0


@pytest.mark.slow
def test_the_batch_runners_sender_marks_its_engine_requests_background_and_a_client_cannot(model_dirs):
    """The ingress's routes in process: a line sent by the batch runner's sender reaches the engine
    as a background request; the same body from a client, with any header or field it may send,
    does not (the mark lives in the ASGI scope's state, which no client reaches). Only the client's
    counts as interactive in flight (the runner sends no line while one is)."""
    model = model_dirs["llama"]
    app = InProcessApp(AsyncEngine(EngineConfig(model=str(model), dtype="float32", torch_threads=1)),
                       AppArgs(model=str(model), served_model_name="llama"))
    seen: list[tuple[bool, int]] = []  # (background, interactive requests in flight) as each reaches the engine
    client = app.view.openai.client
    stream = client.backend.stream
    client.backend.stream = lambda request, trace=None: (
        seen.append((request.background, client.interactive_in_flight)), stream(request, trace))[1]
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        status, answer, _ = app.run(in_process_sender(app.app, None)("/v1/chat/completions", body, "default"))
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        answered = app.send("POST", "/v1/chat/completions", json.dumps(body).encode(),
                            {"content-type": "application/json", "x-batch-line": "true"})
        assert answered.status_code == 200
        assert app.post("/v1/chat/completions", {**body, "background": True}).status_code == 400
        assert client.interactive_in_flight == 0
    finally:
        app.close()
    assert seen == [(True, 0), (False, 1)]


def test_the_runners_probe_counts_interactive_requests_waiting_not_the_batchs_own_lines():
    """Batch lines wait in the engines whenever an interactive request runs; the pacing halves the
    lines in flight only for waiting interactive requests (deployments/ingress/batch_runner.py)."""
    async def stats(waiting: dict[int, int], background: int):
        return SimpleNamespace(waiting_by_priority=waiting, waiting_background=background)

    def handle(waiting: dict[int, int], background: int):
        return SimpleNamespace(stats=SimpleNamespace(remote=lambda: stats(waiting, background)))

    only_lines = {"PrefillServer": handle({1: 0, 5: 3}, 3), "DecodeServer": handle({5: 2}, 2)}
    assert asyncio.run(engines_waiting(only_lines)()) == 0
    with_chat = {"PrefillServer": handle({1: 1, 5: 3}, 3), "DecodeServer": handle({5: 3}, 2)}
    assert asyncio.run(engines_waiting(with_chat)()) == 2
