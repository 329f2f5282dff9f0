"""A running request moved from one engine to another mid-decode (engine/running_export.py, the
ingress's ``moved_leg``: deployments/ingress/migration.py) goes on as if it had never moved: the
same tokens as an undisturbed run, greedy and seeded, nothing computed again on the new engine,
its blocks freed on the old one; with its KV by reference too (the KV connector's ``export`` and
``adopt``), in a small item, and a KV gone before the ingress took it falls back to token replay.
fp32, the tiny Llama."""

from dataclasses import replace

import pytest

from deployments.ingress.migration import moved_leg
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode
from engine.running_export import Moved
from sampling import SamplingParams

PROMPT = [5, 17, 93, 41, 8, 260, 77, 301, 12, 44, 3]
NEW_TOKENS = 20
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)
# Seeded sampling with every control that reads the output so far (as tests/test_engine_resume.py).
SEEDED = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50,
                        repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                        no_repeat_ngram_size=2, seed=1234, logprobs=0)


def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=32))


@pytest.fixture(scope="module")
def engines(model_dirs):
    """The draining engine and the one that takes its requests over."""
    return engine(model_dirs["llama"]), engine(model_dirs["llama"])


def undisturbed(llm: LLMEngine, request: GenerationRequest) -> dict[int, list[int]]:
    """Each choice's tokens, the request run whole on ``llm``."""
    return {o.index: o.output_token_ids for o in llm.generate_choices([request])[request.request_id]}


def tokens_of(outputs) -> dict[int, list[int]]:
    by_choice: dict[int, list[int]] = {}
    for output in outputs:
        by_choice.setdefault(output.index, []).extend(output.new_token_ids)
    return by_choice


def run_moved(source: LLMEngine, target: LLMEngine, request: GenerationRequest, steps: int):
    """``request`` on ``source`` for ``steps`` steps, moved, then to its end on ``target``: the
    outputs by choice (as the ingress delivers them), the Moved, and target's prompt tokens computed."""
    source.add_request(request)
    before = []
    for _ in range(steps):
        before += source.step()
    moved = source.move_out(request.request_id)
    assert isinstance(moved, Moved)
    computed = target.scheduler.num_prompt_tokens_computed
    after = []
    for choice in moved.choices:
        leg, handoff = moved_leg(request, choice, 1)
        target.add_request(leg, Mode.DECODE, handoff)
        outputs = target.run_to_completion()[leg.request_id]
        after += [replace(o, index=choice.index) for o in outputs]
    return tokens_of(before + after), moved, target.scheduler.num_prompt_tokens_computed - computed


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("steps", [2, 9])
def test_moved_request_continues_with_the_same_tokens(engines, params, steps):
    source, target = engines
    whole = undisturbed(source, GenerationRequest("whole", PROMPT, params))
    moved_tokens, moved, computed = run_moved(source, target, GenerationRequest(f"m{steps}", PROMPT, params), steps)
    assert moved_tokens == whole and len(whole[0]) == NEW_TOKENS
    (choice,) = moved.choices
    assert len(choice.output_ids) == steps  # one token a step; the last one is the new engine's first
    assert choice.handoff.kv.meta.num_tokens == len(PROMPT) + steps - 1  # the KV resident: all but the last token
    assert choice.handoff.kv.data.shape[2] == len(PROMPT) + steps - 1
    assert computed == 0  # nothing of the prompt computed again on the new engine
    assert source.blocks.counts().held == 0 and target.blocks.counts().held == 0


def test_every_choice_moves(engines):
    source, target = engines
    whole = undisturbed(source, GenerationRequest("whole3", PROMPT, SEEDED, n=3))
    moved_tokens, moved, computed = run_moved(source, target, GenerationRequest("m3", PROMPT, SEEDED, n=3), 5)
    assert sorted(c.index for c in moved.choices) == [0, 1, 2]
    assert moved_tokens == whole and computed == 0


def test_a_request_that_cannot_move_yet_stays(engines):
    source, _ = engines
    request = GenerationRequest("waiting", PROMPT, GREEDY)
    source.add_request(request)
    assert source.move_out("waiting") is None  # its prompt has not run: nothing to move, nothing changed
    assert source.move_out("not-here") is None
    outputs = source.run_to_completion()["waiting"]
    assert outputs[-1].finished and outputs[-1].num_output_tokens == NEW_TOKENS


def test_the_drain_signal_is_where_ray_serve_sets_it():
    """deployments/replicas/draining.py reads Ray Serve's internal ``_shutting_down`` through this
    process's ReplicaActor: Ray must still set it first in the graceful shutdown, before it waits for
    the ongoing calls (the moves end them), and the actor must still hold its replica as ``_replica_impl``."""
    import inspect

    import ray
    from ray.serve._private import replica

    from deployments.replicas.draining import serve_draining

    shutdown = inspect.getsource(replica.Replica._perform_graceful_shutdown)
    assert shutdown.index("self._shutting_down = True") < shutdown.index("self._drain_ongoing_requests(")
    assert "self._replica_impl" in inspect.getsource(replica.ReplicaActor.__init__)
    assert isinstance(ray._private.worker.global_worker.actors, dict)  # actor id -> this process's actor instance
    assert serve_draining() is False  # no replica here


def test_moved_choices_are_read_together_and_the_first_error_ends_them():
    """A request of several choices moves as one stream per choice (PDBackend._followed): their
    batches are delivered as they come, and one that fails ends the others (token replay then)."""
    import asyncio

    from deployments.pd.backends import _merged

    async def choice(index: int, batches: int, fail: bool = False):
        for step in range(batches):
            await asyncio.sleep(0)
            yield [(index, step)]
        if fail:
            raise ConnectionError(f"choice {index}'s D failed")

    async def read(streams) -> list:
        return [batch async for batch in _merged(streams)]

    got = asyncio.run(read([choice(0, 3), choice(1, 2)]))
    assert sorted(got) == [[(0, 0)], [(0, 1)], [(0, 2)], [(1, 0)], [(1, 1)]]
    assert got.index([(1, 0)]) < got.index([(0, 2)])  # interleaved, not one choice after the other
    with pytest.raises(ConnectionError, match="choice 1"):
        asyncio.run(read([choice(0, 1000), choice(1, 1, fail=True)]))


def test_a_served_stream_ends_with_its_move(model_dirs):
    """AsyncEngine.move_out (what a draining D's watch sends): the request's stream ends with its
    Moved after every output made before it, the engine holds nothing for it, and another engine
    goes on from the Moved to the undisturbed run's tokens."""
    import asyncio

    from engine.async_engine import AsyncEngine

    source = AsyncEngine(EngineConfig(model=str(model_dirs["llama"]), dtype="float32", block_size=4))
    target = engine(model_dirs["llama"])
    # Long enough that the engine thread cannot end it between its first output and the move's command.
    params = replace(SEEDED, max_new_tokens=100, min_new_tokens=100)
    request = GenerationRequest("served", PROMPT, params)

    async def stream_then_move() -> list:
        items = []
        async for batch in source.generate_batches(request):
            if not items:
                source.move_out()
            items += batch
        return items

    try:
        items = asyncio.run(stream_then_move())
        assert isinstance(items[-1], Moved) and not any(isinstance(o, Moved) for o in items[:-1])
        (choice,) = items[-1].choices
        streamed = [t for o in items[:-1] for t in o.new_token_ids]
        assert choice.output_ids == streamed  # the Moved comes after every token the client has
        assert source.engine.blocks.counts().held == 0 and not source.engine.active_request_ids()
    finally:
        source.shutdown()
    leg, handoff = moved_leg(request, choice, 1)
    target.add_request(leg, Mode.DECODE, handoff)
    rest = [t for o in target.run_to_completion()[leg.request_id] for t in o.new_token_ids]
    assert streamed + rest == undisturbed(target, GenerationRequest("whole-served", PROMPT, params))[0]


# The KV by reference (a draining D's ``Moved.by_reference`` with its connector's ``export``, the
# ingress's ``adopt``, the new D's ``load``), over the shared-memory connector: it needs no Ray
# (the object store's, served: tests/test_faults.py's scale-down, benchmarks/kv_move_served.py).
ITEM_BYTES = 2048  # a by-reference Moved pickled, at most, for this prompt and these tokens: whatever its KV's size


@pytest.fixture
def no_segment_left():
    """The test leaves no pdserve segment of its own in /dev/shm (its leases dropped first)."""
    import gc

    from deployments.pd.kv_direct import segments

    before = set(segments())
    yield
    gc.collect()
    assert not set(segments()) - before


def moved_by_reference(source: LLMEngine, request: GenerationRequest, steps: int, connector):
    """``request`` on ``source`` for ``steps`` steps, then moved with its KV by reference (as a
    draining D sends it): its outputs so far and the Moved."""
    source.add_request(request)
    before = []
    for _ in range(steps):
        before += source.step()
    moved = source.move_out(request.request_id)
    moved.by_reference(connector.export)
    return before, moved


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_move_by_reference_continues_with_the_same_tokens(engines, params, no_segment_left):
    import asyncio
    import pickle

    from deployments.pd.kv_connector import PrefillReply
    from deployments.pd.kv_direct import SharedMemoryConnector

    source, target = engines
    connector = SharedMemoryConnector(30.0)
    whole = undisturbed(source, GenerationRequest("whole-ref", PROMPT, params, n=2))
    request = GenerationRequest("ref", PROMPT, params, n=2)
    before, moved = moved_by_reference(source, request, 6, connector)
    assert source.blocks.counts().held == 0  # the draining side freed its blocks at the export
    item = len(pickle.dumps(moved))  # what the channel carries for this request
    assert item <= ITEM_BYTES < moved.nbytes // 4, (item, moved.nbytes)
    assert all(c.handoff.kv.data is None for c in moved.choices)
    computed = target.scheduler.num_prompt_tokens_computed
    after = []
    for choice in moved.choices:  # as the ingress and the new D take it (PDBackend._moved_choice, DecodeServer)
        leg, handoff = moved_leg(request, choice, 1)
        reply = PrefillReply([], handoff, asyncio.run(connector.adopt(choice.kv)))
        target.add_request(leg, Mode.DECODE, handoff)  # blocks first, the bytes once it holds them
        while leg.request_id not in target.take_kv_wanted():
            assert not target.step()
        data, transfer = asyncio.run(connector.load(pickle.loads(pickle.dumps(reply))))
        assert transfer.nbytes == choice.nbytes
        assert target.receive_kv(leg.request_id, data)
        after += [replace(o, index=choice.index) for o in target.run_to_completion()[leg.request_id]]
        del reply
    assert tokens_of(before + after) == whole
    assert target.scheduler.num_prompt_tokens_computed == computed and target.blocks.counts().held == 0


@pytest.mark.parametrize("transport", ["shared_memory", "object_store"])
def test_a_moved_kv_gone_before_the_ingress_took_it_falls_back_to_token_replay(engines, transport, no_segment_left):
    """The draining D's process ended before the ingress adopted its KV (a sweep took the segment;
    Ray answers OwnerDiedError for D's object, as it does when D's worker is gone): the request's
    outputs so far reach the client, then a replica failure, which migration answers with token
    replay; the move is counted as failed, and nothing is held anywhere (the source freed its blocks)."""
    import asyncio
    from collections import Counter

    from ray.exceptions import OwnerDiedError

    from deployments.failures import replica_failed
    from deployments.ingress.migration import resumes
    from deployments.pd.backends import PDBackend
    from deployments.pd.kv_connector import ObjectStoreConnector
    from deployments.pd.kv_direct import SharedMemoryConnector

    source, _ = engines
    connector = SharedMemoryConnector(30.0) if transport == "shared_memory" else ObjectStoreConnector()
    request = GenerationRequest(f"lost-{transport}", PROMPT, GREEDY)

    def export_then_lose(data):
        if transport == "shared_memory":
            segment = connector.export(data)
            segment.path.unlink()  # a sweep, D being gone
            return segment

        async def owner_died():
            raise OwnerDiedError("f" * 56, "", "")
        return owner_died()

    source.add_request(request)
    outputs = source.step() + source.step()
    moved = source.move_out(request.request_id)
    moved.by_reference(export_then_lose)
    backend = object.__new__(PDBackend)  # the ingress's side alone: no D is reached
    backend.kv, backend.moves = connector, Counter()

    async def d_stream():
        yield [*outputs, moved]

    async def read() -> tuple[list, Exception]:
        got = []
        with pytest.raises(Exception) as failure:
            async for batch in backend._followed(request, d_stream(), None):
                got += batch
        return got, failure.value

    got, error = asyncio.run(read())
    assert got == outputs  # what D made before the move reached the client
    assert replica_failed(error) and resumes(error, 0, 2)  # token replay (deployments/ingress/migration.py)
    assert backend.moves == Counter({"choices": 1, "bytes": moved.nbytes, "failed": 1})
    assert source.blocks.counts().held == 0
