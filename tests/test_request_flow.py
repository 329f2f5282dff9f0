"""The ingress's request flow (deployments/ingress/request_flow.py) through the engine client's
``generate``, model-free, over backends that answer on cue: outputs in order, and on every path
(finish, client leaves, replica dies and the request migrates, timeout, an error before the first
token) the admission ticket released once, the trace ended once, the key charged once. The real
faults are in tests/test_faults.py; migration's decisions in tests/test_migration.py."""

import asyncio
from dataclasses import replace
import time

import pytest
import ray

from deployments.failures import ReplicaStalled
from deployments.ingress import request_flow
from deployments.ingress.admission import Admission
from deployments.ingress.engine_client import ServeEngineClient
from dialects.engine_client import Origin
from dialects.errors import APIError
from engine.outputs import LENGTH, TIMEOUT, RequestOutput
from engine.request import GenerationRequest
from sampling import SamplingParams

ORIGIN = Origin("openai", "client-id", 0.0, "key-a")


class Backend:
    """A backend whose ``stream(request, trace)`` is ``answer(request)``'s batches; it counts what
    it was asked and which of its streams were closed."""

    def __init__(self, answer) -> None:
        self.answer, self.calls, self.closed = answer, [], []
        self.handles = {"PrefillServer": None, "DecodeServer": None}

    async def stream(self, request: GenerationRequest, trace=None):
        self.calls.append(request)
        try:
            async for batch in self.answer(request):
                yield batch
        finally:
            self.closed.append(request.request_id)


class Flows:
    """An engine client over ``backend``, recording each trace end and each key charge."""

    def __init__(self, backend: Backend, max_migrations: int = 3) -> None:
        self.admission = Admission("PrefillServer", "DecodeServer", 10_000, 256, lambda _: 1)
        self.ended: list[tuple[str, str]] = []  # (engine request id, outcome)
        self.charged: list[tuple[str, int]] = []
        self.client = ServeEngineClient(None, backend, self.admission, max_migrations,
                                        lambda trace, outcome: self.ended.append((trace.engine_request_id, outcome)))
        self.client.charge = lambda key, tokens: self.charged.append((key, tokens))

    def in_flight(self) -> tuple[int, int]:
        return self.admission.load["PrefillServer"].tokens, self.admission.load["DecodeServer"].tokens


def output(request: GenerationRequest, token: int, finished: bool = False, index: int = 0,
           reason: str = LENGTH) -> RequestOutput:
    return RequestOutput(request.request_id, [token], f"<{token}>", token, finished, reason if finished else None,
                         seed=7 + index, index=index)


def request(request_id: str = "r", tokens: int = 4, n: int = 1) -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3], SamplingParams(max_new_tokens=tokens, seed=7),
                             deadline=time.time() + 60, n=n)


def counting(tokens: int = 4):
    """Answers tokens 1..tokens, one per batch but the last two together."""
    async def answer(r: GenerationRequest):
        for t in range(1, tokens - 1):
            yield [output(r, t)]
            await asyncio.sleep(0)
        yield [output(r, tokens - 1), output(r, tokens, finished=True)]
    return answer


async def collect(flows: Flows, requests: list[GenerationRequest], leave_after: int | None = None):
    generation = await flows.client.generate(requests, ORIGIN)
    seen = []
    async for index, out in generation:
        seen.append((index, out.request_id, out.new_token_ids[0]))
        if leave_after is not None and len(seen) == leave_after:
            await generation.abort()  # the client went away
            break
    return seen


def every_output(flows: Flows, requests: list[GenerationRequest]) -> list[RequestOutput]:
    """Every output of ``requests``' generation, in order."""
    async def run():
        return [o async for _, o in await flows.client.generate(requests, ORIGIN)]
    return asyncio.run(run())


def test_outputs_come_in_order_and_a_finished_request_releases_ends_and_charges_once():
    backend = Backend(counting())
    flows = Flows(backend)
    seen = asyncio.run(collect(flows, [request()]))
    assert seen == [(0, "r", 1), (0, "r", 2), (0, "r", 3), (0, "r", 4)]
    assert flows.ended == [("r", "finished")] and flows.in_flight() == (0, 0)
    assert flows.charged == [("key-a", 3), ("key-a", 4)]  # the prompt at the start, the 4 tokens at the end


def test_several_requests_keep_each_ones_order_and_each_ends_once():
    backend = Backend(counting(5))
    flows = Flows(backend)
    seen = asyncio.run(collect(flows, [request("a", 5), request("b", 5)]))
    for index, name in enumerate("ab"):
        assert [t for i, r, t in seen if i == index and r == name] == [1, 2, 3, 4, 5]
    assert sorted(flows.ended) == [("a", "finished"), ("b", "finished")] and flows.in_flight() == (0, 0)


def test_p_is_released_at_the_first_output_and_d_at_the_end():
    held = []

    async def answer(r: GenerationRequest):
        yield [output(r, 1)]
        held.append(flows.in_flight())  # read while the request runs
        yield [output(r, 2, finished=True)]

    flows = Flows(Backend(answer))
    asyncio.run(collect(flows, [request(tokens=2)]))
    assert held == [(0, 5)] and flows.in_flight() == (0, 0)  # D holds prompt + max_new_tokens until the end


def test_a_client_that_leaves_closes_the_backend_stream_and_ends_once_as_cancelled():
    async def endless(r: GenerationRequest):
        t = 0
        while True:
            t += 1
            yield [output(r, t)]
            await asyncio.sleep(0)

    backend = Backend(endless)
    flows = Flows(backend)
    seen = asyncio.run(collect(flows, [request()], leave_after=3))
    assert [t for _, _, t in seen] == [1, 2, 3]
    assert backend.closed == ["r"] and flows.ended == [("r", "cancelled")] and flows.in_flight() == (0, 0)
    assert flows.charged[0] == ("key-a", 3) and len(flows.charged) == 2  # the prompt, then what was generated


def test_a_replica_that_dies_mid_stream_migrates_and_the_flow_ends_once():
    async def dies_once(r: GenerationRequest):
        start = len(r.resumed_output_ids)
        for t in range(start + 1, 5):
            if r.request_id == "r" and t == 3:
                raise ray.exceptions.ActorDiedError()
            yield [output(r, t, finished=t == 4)]

    backend = Backend(dies_once)
    flows = Flows(backend)
    seen = asyncio.run(collect(flows, [request()]))
    assert [(r, t) for _, r, t in seen] == [("r", 1), ("r", 2), ("r", 3), ("r", 4)]  # none lost, none twice
    assert [c.request_id for c in backend.calls] == ["r", "r.m1.0"]
    assert flows.ended == [("r", "finished")] and flows.in_flight() == (0, 0)


def test_a_deadline_passed_before_the_first_token_is_a_408_before_any_output():
    async def late(r: GenerationRequest):
        yield [RequestOutput(r.request_id, [], "", 0, True, TIMEOUT, seed=7)]

    flows = Flows(Backend(late))
    with pytest.raises(APIError) as raised:
        asyncio.run(collect(flows, [request()]))
    assert raised.value.status == 408 and raised.value.code == "timeout"
    assert flows.ended == [("r", "finished")] and flows.in_flight() == (0, 0)


def test_a_timeout_after_the_first_token_is_the_requests_last_output():
    async def then_late(r: GenerationRequest):
        yield [output(r, 1)]
        yield [RequestOutput(r.request_id, [], "", 1, True, TIMEOUT, seed=7)]

    flows = Flows(Backend(then_late))
    generation_outputs = every_output(flows, [request()])
    assert [o.finish_reason for o in generation_outputs] == [None, TIMEOUT]  # the dialect answers it
    assert flows.ended == [("r", "finished")] and flows.in_flight() == (0, 0)


def test_a_replica_that_fails_past_the_deadline_ends_the_request_as_timed_out_not_migrated():
    """D stopped until past the deadline, then found stalled: no replacement can answer in time, so
    the request ends as the engine ends one at its deadline (the dialect's timeout error), not as a
    migration that fails (a 503 in the stream)."""
    async def stalls(r: GenerationRequest):
        yield [output(r, 1)]
        raise ReplicaStalled("the replica serving this request gave no sign of life for 5 s")

    backend = Backend(stalls)
    flows = Flows(backend)
    outputs = every_output(flows, [replace(request(), deadline=time.time() - 1)])
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([1], None), ([], TIMEOUT)]
    assert [c.request_id for c in backend.calls] == ["r"]
    assert flows.ended == [("r", "finished")] and flows.in_flight() == (0, 0)


def test_a_request_no_engine_ends_is_timed_out_by_the_ingress_its_streams_closed(monkeypatch, caplog):
    """Defence in depth: a backend path that waits on something that never answers. Past the
    deadline and its grace the ingress ends the request as the engine would have: a TIMEOUT output
    with the choice's tokens so far after the first token (a stream's timeout error event), a 408
    before it; the backend's stream is closed (its replicas abort the request) and a warning names it."""
    monkeypatch.setattr(request_flow, "DEADLINE_GRACE_S", 0.0)

    async def never_ends(r: GenerationRequest):
        if r.request_id == "streaming":
            yield [output(r, 1)]
        await asyncio.Event().wait()
        yield []

    backend = Backend(never_ends)
    flows = Flows(backend)
    outputs = every_output(flows, [replace(request("streaming"), deadline=time.time() + 1)])
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([1], None), ([], TIMEOUT)]
    assert (outputs[-1].output_token_ids, outputs[-1].text, outputs[-1].seed) == ([1], "<1>", 7)
    with pytest.raises(APIError) as raised:
        every_output(flows, [replace(request("silent"), deadline=time.time())])
    assert raised.value.status == 408 and raised.value.code == "timeout"
    assert backend.closed == ["streaming", "silent"]
    assert flows.ended == [("streaming", "finished"), ("silent", "finished")] and flows.in_flight() == (0, 0)
    assert "request streaming: no engine ended it" in caplog.text and "request silent:" in caplog.text


def test_an_error_before_the_first_token_is_a_4xx_and_the_other_requests_end():
    async def refuses(r: GenerationRequest):
        if r.request_id == "bad":
            raise ValueError("top_k: must be < 1024")
        yield [output(r, 1)]
        await asyncio.Event().wait()  # still running when the other fails
        yield []

    backend = Backend(refuses)
    flows = Flows(backend)
    with pytest.raises(APIError) as raised:
        asyncio.run(collect(flows, [request("good"), request("bad")]))
    assert raised.value.status == 400 and "top_k" in raised.value.message
    assert sorted(flows.ended) == [("bad", "error"), ("good", "cancelled")] and flows.in_flight() == (0, 0)
    assert "good" in backend.closed


def test_an_error_after_the_first_token_ends_the_generation_with_it_once():
    async def fails_later(r: GenerationRequest):
        yield [output(r, 1)]
        raise RuntimeError("the engine failed")

    flows = Flows(Backend(fails_later))
    with pytest.raises(APIError) as raised:
        asyncio.run(collect(flows, [request()]))
    assert raised.value.status == 500
    assert flows.ended == [("r", "error")] and flows.in_flight() == (0, 0)


def test_a_request_the_admission_refuses_is_a_503_and_the_started_one_is_released():
    flows = Flows(Backend(counting()))
    flows.admission.tokens_per_replica = 8  # room for one request of 7 tokens at priority 5 ... only alone
    with pytest.raises(APIError) as raised:
        asyncio.run(collect(flows, [request("a"), request("b")]))
    assert raised.value.status == 503 and raised.value.code == "overloaded"
    assert flows.in_flight() == (0, 0) and flows.ended == [("a", "cancelled")]  # started, then cancelled
