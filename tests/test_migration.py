"""deployments/ingress/migration.py's decisions, as the request flow applies them
(deployments/ingress/request_flow.py, through the engine client), with engines that fail on cue:
what is sent again after a replica failure, when, and how often. The real faults (a replica killed
mid-stream) are in tests/test_faults.py."""

import asyncio
import time

import pytest
import ray

from dialects.errors import APIError
from engine.outputs import LENGTH, RequestOutput
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.test_request_flow import ORIGIN, Backend, Flows


def output(request: GenerationRequest, index: int, token: int, count: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request.request_id, [token], f"<{token}>", count, finished, LENGTH if finished else None,
                         seed=request.params.seed + index, index=index)


class Engines:
    """Answers each request with tokens 1, 2, ... per choice; ``failures`` says after how many
    outputs the n-th call fails (None: it does not)."""

    def __init__(self, failures: list[int | None], error: Exception | None = None) -> None:
        self.failures, self.error = list(failures), error or ray.exceptions.ActorDiedError()
        self.calls: list[GenerationRequest] = []

    async def start(self, request: GenerationRequest):
        self.calls.append(request)
        fail_after = self.failures.pop(0) if self.failures else None
        sent = 0
        done = {j: len(request.resumed_output_ids) for j in range(request.n)}
        while any(count < request.params.max_new_tokens for count in done.values()):
            for j in range(request.n):
                if done[j] == request.params.max_new_tokens:
                    continue
                if sent == fail_after:
                    raise self.error
                done[j] += 1
                sent += 1
                yield output(request, j, done[j], done[j], done[j] == request.params.max_new_tokens)
                await asyncio.sleep(0)


def migrating(start, request: GenerationRequest, max_migrations: int) -> list[RequestOutput]:
    """``request``'s outputs through a request flow over ``start(request)``'s outputs, one a batch."""
    async def batches(r: GenerationRequest):
        async for out in start(r):
            yield [out]

    async def collect():
        generation = await Flows(Backend(batches), max_migrations).client.generate([request], ORIGIN)
        return [o async for _, o in generation]
    return asyncio.run(collect())


def run(engines: Engines, request: GenerationRequest, max_migrations: int = 3) -> list[RequestOutput]:
    return migrating(engines.start, request, max_migrations)


def request(n: int = 1, seed: int = 7, tokens: int = 4) -> GenerationRequest:
    return GenerationRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=tokens, seed=seed, prompt_logprobs=1),
                             deadline=time.time() + 60, n=n)


def tokens_by_choice(outputs: list[RequestOutput], n: int) -> list[list[int]]:
    return [[t for o in outputs if o.index == j for t in o.new_token_ids] for j in range(n)]


def test_without_failures_nothing_is_sent_again():
    engines = Engines([None])
    outputs = run(engines, request())
    assert tokens_by_choice(outputs, 1) == [[1, 2, 3, 4]] and len(engines.calls) == 1


def test_a_failure_before_any_output_sends_the_request_again_as_it_was():
    engines = Engines([0, None])
    outputs = run(engines, request(n=2))
    assert tokens_by_choice(outputs, 2) == [[1, 2, 3, 4]] * 2
    retry = engines.calls[1]
    assert retry.n == 2 and retry.resumed_output_ids == [] and retry.request_id == "r.m1"
    assert retry.params.prompt_logprobs == 1  # nothing was sent: the prompt is scored as asked


def test_a_beam_search_that_fails_after_p_replied_is_sent_again_whole():
    """P's reply to a beam search carries no token (its beams go to D): nothing reached the client."""
    beam = GenerationRequest("b", [1, 2, 3], SamplingParams(max_new_tokens=4, beam_width=2), deadline=time.time() + 60)

    async def start(r: GenerationRequest):
        calls.append(r)
        yield RequestOutput(r.request_id, [], "", 0, False, None, seed=5)  # P's reply
        if len(calls) == 1:
            raise ray.exceptions.ActorDiedError()  # D died
        yield RequestOutput(r.request_id, [9, 9], "xx", 2, True, LENGTH, seed=5)

    calls: list[GenerationRequest] = []
    outputs = migrating(start, beam, 3)
    assert outputs[-1].new_token_ids == [9, 9] and [c.request_id for c in calls] == ["b", "b.m1"]
    assert calls[1].params == beam.params and calls[1].resumed_output_ids == []


def test_a_failure_mid_stream_resumes_each_unfinished_choice_after_what_it_sent():
    engines = Engines([3, None, None])  # choice 0 has tokens 1, 2; choice 1 has token 1
    outputs = run(engines, request(n=2))
    assert tokens_by_choice(outputs, 2) == [[1, 2, 3, 4]] * 2  # none lost, none twice
    assert all(o.request_id == "r" for o in outputs)
    resumed = {r.request_id: r for r in engines.calls[1:]}
    assert set(resumed) == {"r.m1.0", "r.m1.1"}
    assert resumed["r.m1.0"].resumed_output_ids == [1, 2] and resumed["r.m1.1"].resumed_output_ids == [1]
    assert [r.params.seed for r in resumed.values()] == [7, 8]  # the seeds they ran with
    assert all(r.n == 1 and r.params.prompt_logprobs is None and r.priority == 5 for r in resumed.values())
    assert all(r.deadline == engines.calls[0].deadline for r in resumed.values())  # not reset


def test_a_finished_choice_is_not_resumed():
    engines = Engines([7, None])  # choice 0 and 1 interleave; 7 outputs: choice 0 done, choice 1 at 3
    outputs = run(engines, request(n=2))
    assert tokens_by_choice(outputs, 2) == [[1, 2, 3, 4]] * 2
    assert [r.request_id for r in engines.calls[1:]] == ["r.m1.1"]


def test_after_max_migrations_the_failure_ends_the_request():
    engines = Engines([1, 0, 0, 0])
    with pytest.raises(APIError) as raised:
        run(engines, request(), max_migrations=3)
    assert raised.value.status == 503 and raised.value.code == "replica_unavailable"
    assert len(engines.calls) == 4


def test_an_error_that_is_not_a_replica_failure_is_not_retried():
    engines = Engines([1, None], error=ValueError("top_k: must be < 1024"))
    with pytest.raises(APIError, match="top_k") as raised:
        run(engines, request())
    assert raised.value.status == 400
    assert len(engines.calls) == 1


def test_a_replacement_that_does_not_answer_before_the_deadline_is_a_clean_503():
    calls = []

    async def start(r: GenerationRequest):
        calls.append(r)
        if len(calls) == 1:
            raise ray.exceptions.ActorUnavailableError("x", b"1" * 16)
        await asyncio.Event().wait()  # no replica answers
        yield  # an async generator

    r = request()
    r.deadline = time.time() + 0.2
    with pytest.raises(APIError) as raised:
        migrating(start, r, 3)
    assert raised.value.status == 503 and raised.value.code == "replica_unavailable" and len(calls) == 2
