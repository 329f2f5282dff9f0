"""A running request moved from one engine to another mid-decode (engine/running_export.py, the
ingress's ``moved_leg``: deployments/ingress/migration.py) goes on as if it had never moved: the
same tokens as an undisturbed run, greedy and seeded, nothing computed again on the new engine,
its blocks freed on the old one. fp32, the tiny Llama."""

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
