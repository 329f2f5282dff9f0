"""Faults, injected for real, against the failure contract (docs/serving.md): a D replica killed
mid-stream (one of two), a D replica stopped mid-stream (one of two), the one colocated replica
killed mid-stream, P killed between its reply and D's fetch, every D stopped (P serves alone, then PD
comes back); last, D scaled down 2 -> 1 mid-stream (Serve drains one: its streams move with their KV).
Each fault is proven (a replica or process is gone or still stopped, the ingress counted
migrations); every stream completes with the tokens a fault-free run gives (seeded sampling too:
the migrated continuation is the same sampling process) or ends with its dialect's clean error;
nothing of Ray's reaches a client; serving goes on."""

import asyncio
import concurrent.futures
import contextlib
import json
import re
import threading
import time

import httpx
import psutil
import pytest
import ray
from ray import serve
from ray.serve import Application

from deployments.app import colocated_app, pd_app
from deployments.pd.backends import PDBackend
from deployments.config import AppArgs
from deployments.failures import (DeadlineBeforeFirstToken, LateReplacement, NoDecodeReplica, NoPrefillReplica,
                                  RateCounterDown, RateLimited)
from deployments.ingress.admission import Overloaded
from deployments.ingress.engine_client import client_error
from dialects.errors import APIError
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.serving import (HEALTHY_AGAIN_S, RAY_INTERNALS, REPLICA_RESTART_S, assert_nothing_held, call_replica,
                           deploy, healthy, migrations, pd_metric, processes, replica_process, replicas, serve_session,
                           sigkill, stopped, versioned, wait_until, work_done)

LONG = 800  # tokens a stream asks for: it is still running when the replica is killed (~5 s of decoding here)
DECODE_REPLICAS = 2
KV_LEASE_S = 6
STALL_TIMEOUT_S = 3


def the_pd_app(decode_replicas: int = DECODE_REPLICAS) -> Application:
    """The "pd" app, with ``decode_replicas`` D replicas (redeployed with fewer: a scale-down)."""
    return versioned(pd_app({"torch_threads": 1, "max_iter_times": LONG, "embeddings": False, "dtype": "float32",
                             "kv_lease_s": KV_LEASE_S, "stall_timeout_s": STALL_TIMEOUT_S,
                             "pd_local_prefill_tokens": 0},
                            decode_options={"num_replicas": decode_replicas, "ray_actor_options": {  # fault hooks on
                                "num_cpus": 1, "runtime_env": {"env_vars": {"PDSERVE_FAULT_HOOKS": "1"}}}}))


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        # A migrated stream recomputes its tokens' KV in one prefill; batch-invariant mode (on in the suite,
        # tests/conftest.py) makes that equal to the KV the decode steps wrote in every dtype: PD in float32,
        # colocated in bfloat16, so each exact-text assertion holds in both.
        deploy({"pd": the_pd_app(),
                "co": colocated_app({"torch_threads": 1, "max_iter_times": LONG, "embeddings": False,
                                     "dtype": "bfloat16", "batch_invariant": True})}, {"pd": "/"})
        for app_url in (url, f"{url}/co"):  # each ingress has learnt its engines before any fault
            eventually_ok(app_url)
        yield url


def decode_replicas() -> set[str]:
    return replicas("DecodeServer", "pd")


def bodies(stream: bool) -> list[tuple[str, dict]]:
    """Two streams per dialect, each its own prompt: greedy, and seeded sampling."""
    sampled = {"temperature": 0.8, "top_k": 40, "seed": 11}
    return [("/v1/completions", {"model": "tiny-llama", "prompt": f"story {i}", "max_tokens": LONG,
                                 "ignore_eos": True, "stream": stream, **(sampled if i else {"temperature": 0})})
            for i in range(2)] + \
           [("/infer_token", {"input_id": [1, 40 + i, 41, 42], "stream": stream,
                              "parameters": {"max_new_tokens": LONG, "ignore_eos": True, "details": True,
                                             **({"do_sample": True, **sampled} if i else {"do_sample": False})}})
            for i in range(2)]


def text_of(path: str, events: list[dict]) -> str:
    """The whole text a stream delivered, after checking that it finished with every token."""
    if path == "/infer_token":
        last = events[-1]
        assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == LONG, last
        tokens = [e["token"] for e in events if e["token"] is not None]
        assert len(tokens) == LONG and tokens[-1]["text"] is None  # seeds/000: the last event's text is null
        assert last["generated_text"].startswith("".join(t["text"] for t in tokens[:-1]))  # and this has it all
        return last["generated_text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    return "".join(e["choices"][0]["text"] for e in events)


def read_stream(url: str, path: str, body: dict, started: concurrent.futures.Future, fault_done) -> str:
    """Read five events, say so, wait for the fault, read the rest; the text delivered."""
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            assert not RAY_INTERNALS.search(line), line
            if line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                assert "error" not in events[-1], line
            if len(events) == 5 and not started.done():
                started.set_result(True)
                fault_done.wait(60)
    return text_of(path, events)


def reference_text(url: str, path: str, body: dict) -> str:
    response = httpx.post(f"{url}{path}", json={**body, "stream": False}, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["generated_text"] if path == "/infer_token" else answer["choices"][0]["text"]


def fault_free_texts(url: str) -> list[str]:
    """The text a fault-free run of each of ``bodies(False)`` gives, the four asked at once
    (batch-invariant mode, tests/conftest.py: the same texts as one at a time, as the four streams
    under test are batched too)."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda pb: reference_text(url, *pb), bodies(False)))


@pytest.fixture(scope="module")
def reference_texts(base_url) -> list[str]:
    """``fault_free_texts``, asked once, before the first fault: the three tests whose streams run
    ``bodies(True)`` compare with it (the same requests to the same app; each asked again after its
    fault was 4 x LONG tokens more to decode, ~6 s a test alone on two cores)."""
    return fault_free_texts(base_url)


def test_each_failure_maps_to_a_status_a_client_can_act_on():
    told = {kind: client_error(error) for kind, error in {
        "died": ray.exceptions.ActorDiedError(), "unavailable": ray.exceptions.ActorUnavailableError("x", b"1" * 16),
        "lost": ray.exceptions.ObjectLostError("ab" * 14, "owner 10.0.0.7:1234", ""), "late": TimeoutError(),
        "bug": KeyError("pid 4242 at 10.0.0.7"), "field": ValueError("top_k: must be < 1024"),
        "api": APIError(404, "model: no", "model"), "no D": NoDecodeReplica("off"),
        "no P": NoPrefillReplica("off")}.items()}
    assert [told[k].status for k in ("died", "unavailable", "lost", "late", "bug", "field", "api", "no D", "no P")] == \
        [503, 503, 503, 504, 500, 400, 404, 503, 503]
    assert (told["no D"].body()["error"]["code"], told["no P"].body()["error"]["code"]) == \
        ("no_decode_replica", "no_prefill_replica")
    assert told["died"].response().headers["retry-after"] == "1" and told["field"].param == "top_k"
    for kind in ("died", "unavailable", "lost", "late", "bug"):
        assert not RAY_INTERNALS.search(json.dumps(told[kind].body())), told[kind].body()


def test_the_serving_systems_own_refusals_map_to_their_statuses():
    """deployments/ raises its own types and never a dialect's; the engine client's mapping gives each
    its status, code and Retry-After, its message unchanged."""
    told = {kind: client_error(error) for kind, error in {
        "full": Overloaded("the server is at capacity", retry_after=2), "limited": RateLimited("rpm of key k", 7),
        "counter": RateCounterDown("the rate-limit counter does not answer; retry"),
        "deadline": DeadlineBeforeFirstToken("request timed out"),
        "late": LateReplacement("no replica took over")}.items()}
    assert {k: (e.status, e.code, e.retry_after) for k, e in told.items()} == {
        "full": (503, "overloaded", 2), "limited": (429, "rate_limit_exceeded", 7), "counter": (503, "not_ready", None),
        "deadline": (408, "timeout", None), "late": (503, "replica_unavailable", 1)}
    assert (told["limited"].message, told["deadline"].param) == ("rpm of key k", "timeout")


@contextlib.contextmanager
def streams_running(url: str):
    """The four streams of ``bodies``, each having read five events and waiting for the fault:
    yields their texts' futures and the event that lets them read on."""
    fault_done = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        started = [concurrent.futures.Future() for _ in bodies(True)]
        texts = [pool.submit(read_stream, url, path, body, f, fault_done)
                 for (path, body), f in zip(bodies(True), started)]
        concurrent.futures.wait(started, timeout=120)
        try:
            yield texts, fault_done
        finally:
            fault_done.set()


def test_the_engine_figures_on_metrics_are_every_replicas_summed(base_url):
    """/metrics' engine figures of D (two replicas here) are the sum of what each replica says,
    read directly, once requests have ended on both (bounded: requests until both have some)."""
    def ended_by_replica() -> list[int]:
        return [sum(call_replica(name, "stats").finished_by_reason.values()) for name in sorted(decode_replicas())]

    for i in range(40):
        if all(ended_by_replica()):
            break
        reference_text(base_url, "/infer_token", {"input_id": [1, 300 + i, 301, 302],
                                                  "parameters": {"max_new_tokens": 2, "ignore_eos": True}})
    ended = ended_by_replica()
    assert len(ended) == DECODE_REPLICAS and all(ended), ended  # each replica's count differs from the sum
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    samples = re.findall(r'^pdserve_engine_requests_finished\{deployment="DecodeServer",reason="[^"]+"\} (\S+)$', text,
                         re.MULTILINE)
    assert sum(map(float, samples)) == sum(ended) == work_done("DecodeServer", "pd")["finished"]


@pytest.mark.slow
def test_decode_replica_killed_mid_stream_every_stream_completes(base_url, reference_texts):
    before_kill = migrations(base_url)
    replicas = decode_replicas()
    assert len(replicas) == DECODE_REPLICAS
    with streams_running(base_url) as (texts, fault_done):
        killed = sorted(replicas)[0]  # the router spreads four streams over both replicas
        ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
        fault_done.set()
        streamed = [t.result(timeout=300) for t in texts]
    assert migrations(base_url) > before_kill  # streams were on the killed replica, and moved
    assert killed not in decode_replicas()
    # No token lost or repeated: each text is the one a fault-free run of the same request gives.
    assert streamed == reference_texts
    serving_resumes(base_url, killed)


@pytest.mark.slow
def test_decode_replica_stopped_mid_stream_its_streams_move_and_complete_while_it_stays_stopped(base_url,
                                                                                            reference_texts):
    """SIGSTOP kills nothing, so Ray reports nothing: the ingress must notice the silence (no token,
    no heartbeat for STALL_TIMEOUT_S), move the streams to the other D, and keep the migrated
    requests off the stopped one (else each would wait out a KV lease there and move again)."""
    before = migrations(base_url)
    with streams_running(base_url) as (texts, fault_done):
        # A D with streams open (the router may have put all four on one replica).
        holding = [name for name in sorted(decode_replicas()) if call_replica(name, "holdings")["streams"] > 0]
        assert holding
        frozen = replica_process(holding[0])
        with stopped("DecodeServer", only=frozen):
            fault_done.set()
            streamed = [t.result(timeout=300) for t in texts]  # every stream ended while D was stopped
            moved = migrations(base_url) - before
        assert frozen.is_running()  # stopped, never killed: only the ingress's watch could see it
    assert 0 < moved <= len(texts)  # each stream on the stopped D moved once, to the live one
    assert streamed == reference_texts
    # Running again, the stopped D learns its calls were cancelled and frees what they held.
    assert_nothing_held(["DecodeServer"], "pd", 120)
    eventually_ok(base_url)


def serving_resumes(url: str, killed: str, role: str = "DecodeServer", count: int = DECODE_REPLICAS) -> None:
    """Serve replaces the killed replica of ``role`` (bounded wait) and a new request through the
    ingress succeeds: the next test starts with every replica the app had running, none of them dead
    or still starting (a starting replica's actor is listed, but does not answer until its engine is up)."""
    def replaced() -> bool:
        running = serve.status().applications["pd"].deployments[role].replica_states.get("RUNNING", 0)
        return killed not in replicas(role, "pd") and len(replicas(role, "pd")) == count == running

    assert wait_until(replaced, REPLICA_RESTART_S, 0.5), serve.status().applications["pd"].deployments[role]
    eventually_ok(url)
    # ... and the ingress reaches both roles again (its router may learn of the new replica later than
    # Serve's status says it runs: meanwhile it serves with one role, and a request succeeds anyway).
    assert wait_until(lambda: healthy(url), HEALTHY_AGAIN_S, 0.5)


def eventually_ok(url: str) -> None:
    """A new request succeeds within a bounded wait; every answer before it is a clean 503."""
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        if response.status_code == 200:
            return
        assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
        assert not RAY_INTERNALS.search(response.text), response.text
    pytest.fail("no request succeeded within 180 s of the fault")


def events_of(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            assert not RAY_INTERNALS.search(line), line
            events.append(json.loads(line[6:]))
    return events


@pytest.mark.slow
def test_prefill_killed_after_its_reply_before_decode_fetched_the_kv(base_url):
    """Through the ingress's own seam (PDBackend), so that nothing stands between P's reply and
    D's call but the fault: P answers, P's process is SIGKILLed and gone, then D fetches the KV."""
    backend = PDBackend(serve.get_deployment_handle("PrefillServer", "pd"),
                        serve.get_deployment_handle("DecodeServer", "pd"), KV_LEASE_S, STALL_TIMEOUT_S,
                        AppArgs().disaggregation)
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    # A prompt whose KV is larger than what Ray inlines (100 KiB): it lives in P's node's object store.
    prompt = [1] + [(7 * i) % 800 + 3 for i in range(600)]

    async def prefill_kill_decode() -> list[int]:
        request = GenerationRequest("p-killed", prompt, params)
        reply = await backend.prefill_step(request)
        meta = reply.handoff.kv.meta
        assert meta.num_layers * 2 * meta.num_tokens * meta.num_kv_heads * meta.head_dim * 4 > 100 * 1024
        (prefill,) = processes("PrefillServer")
        sigkill(prefill)  # the fault happened: P is gone, its KV not fetched yet
        outputs = [o async for batch in backend.decode_step(request, reply) for o in batch]
        return reply.outputs[0].new_token_ids + [t for o in outputs for t in o.new_token_ids]

    async def fault_free() -> list[int]:
        outputs = [o async for batch in backend.stream(GenerationRequest("p-alive", prompt, params)) for o in batch]
        return [t for o in outputs for t in o.new_token_ids]

    async def both() -> tuple[list[int], list[int]]:
        # One event loop for both, as in the ingress: the backend's channel readers are tasks of the
        # loop that opened them. A second asyncio.run would cancel the first loop's reader to D on its
        # way out, and D, told late, would close the channel under the request just accepted on it.
        return await prefill_kill_decode(), await fault_free()

    (killed,) = replicas("PrefillServer", "pd")
    tokens, expected = asyncio.run(both())  # D read the KV of a dead P: no error, no prefill again
    assert len(tokens) == 64 and tokens == expected
    # The ingress, too, has the new P before the next test: a request it routed to the dead P would
    # spend one of its migrations there (the KV-lease test below counts them).
    serving_resumes(base_url, killed, "PrefillServer", 1)


def served_by_p_alone(url: str) -> float:
    return pd_metric(url, "pdserve_pd_prefill_decisions", 'reason="no_decode_replica",where="prefill_only"')


DEGRADED_PROMPT = 400  # tokens of each prompt, as in the report (8 such requests hung 60 s)


def degraded_body(i: int, stream: bool = False) -> dict:
    prompt = [1] + [(37 * i + 11 * j) % 880 + 5 for j in range(DEGRADED_PROMPT - 1)]  # ids < tiny-llama's 891
    return {"input_id": prompt, "stream": stream,
            "parameters": {"max_new_tokens": 16, "ignore_eos": True, "do_sample": False, "details": True}}


@pytest.mark.slow
def test_no_decode_replica_answering_p_serves_alone_then_pd_comes_back(base_url):
    """Every D SIGSTOPped (nothing dies, Ray reports nothing): the ingress's probes go unanswered, and
    within about stall_timeout_s /health says degraded; the request that waited for a D with its
    first token sent moves to P and completes there; 8 new requests with 400-token prompts (the
    issue's reproduction: all hung until the client's 60 s) are served by P alone with the tokens
    PD gives. After SIGCONT, D answers again and new requests go through P then D."""
    path = "/infer_token"
    references = [reference_text(base_url, path, degraded_body(i)) for i in range(9)]  # through P and D
    alone_before, migrated_before = served_by_p_alone(base_url), migrations(base_url)
    decode = processes("DecodeServer")
    with stopped("DecodeServer"):
        stopped_at = time.monotonic()
        with httpx.stream("POST", f"{base_url}{path}", json=degraded_body(8, stream=True), timeout=60) as waiting:
            assert waiting.status_code == 200  # P's first token: the request now waits for a D to take its KV
            lines = waiting.iter_lines()
            first = events_of([next(line for line in lines if line.startswith("data: "))])

            def degraded() -> bool:
                body = httpx.get(f"{base_url}/health", timeout=30).json()
                return body["status"] == "degraded" and "no decode replica" in body["reason"]

            assert wait_until(degraded, 60, 0.1)
            print(f"\n/health: degraded {time.monotonic() - stopped_at:.2f} s after every D was stopped "
                  f"(stall_timeout_s={STALL_TIMEOUT_S})")
            waited = first + events_of(lines)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: httpx.post(f"{base_url}{path}", json=degraded_body(i), timeout=60),
                                    range(8)))
        assert all(p.is_running() and p.status() == psutil.STATUS_STOPPED for p in decode)  # the fault held
        assert pd_metric(base_url, "pdserve_pd_decode_replicas_answering") == 0
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
    assert [a.json()["generated_text"] for a in answers] == references[:8]
    assert waited[-1]["generated_text"] == references[8] and waited[-1]["details"]["generated_tokens"] == 16
    assert migrations(base_url) == migrated_before + 1  # the waiting one moved, once
    assert served_by_p_alone(base_url) == alone_before + 9
    # D runs again: it answers the probes, /health is ok again, and new requests go through P then D.
    assert wait_until(lambda: healthy(base_url), HEALTHY_AGAIN_S, 0.5)
    alone = served_by_p_alone(base_url)
    assert reference_text(base_url, path, degraded_body(0)) == references[0]
    assert served_by_p_alone(base_url) == alone
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd", 120)


def served_by_d_alone(url: str) -> float:
    return pd_metric(url, "pdserve_pd_prefill_decisions", 'reason="no_prefill_replica",where="decode_only"')


@pytest.mark.slow
def test_no_prefill_replica_answering_d_serves_alone_then_pd_comes_back(base_url):
    """Every P SIGSTOPped: within about stall_timeout_s /health says degraded naming P; a request
    sent as P stopped, with a prompt no D holds (its P call never taken), moves to D, which
    computes its prompt and completes it; 8 more requests are served by D alone with the tokens PD
    gave them before the fault. After SIGCONT, P answers again and new requests go through P then D."""
    path = "/infer_token"
    references = [reference_text(base_url, path, degraded_body(i)) for i in range(8)]  # through P and D
    alone_before, migrated_before = served_by_d_alone(base_url), migrations(base_url)
    computed_before = work_done("DecodeServer", "pd")["prompt_tokens_computed"]
    prefill = processes("PrefillServer")
    with stopped("PrefillServer"), concurrent.futures.ThreadPoolExecutor(8) as pool:
        waiting = pool.submit(httpx.post, f"{base_url}{path}", json=degraded_body(9), timeout=60)

        def degraded() -> bool:
            body = httpx.get(f"{base_url}/health", timeout=30).json()
            return body["status"] == "degraded" and "no prefill replica" in body["reason"]

        assert wait_until(degraded, 60, 0.1)
        answers = list(pool.map(lambda i: httpx.post(f"{base_url}{path}", json=degraded_body(i), timeout=60),
                                range(8)))
        waited = waiting.result()
        assert all(p.is_running() and p.status() == psutil.STATUS_STOPPED for p in prefill)  # the fault held
        assert pd_metric(base_url, "pdserve_pd_prefill_replicas_answering") == 0
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
    assert [a.json()["generated_text"] for a in answers] == references
    assert waited.status_code == 200 and waited.json()["details"]["generated_tokens"] == 16, waited.text
    assert migrations(base_url) > migrated_before  # the waiting one left the stopped P ...
    assert work_done("DecodeServer", "pd")["prompt_tokens_computed"] >= computed_before + DEGRADED_PROMPT  # for D
    assert served_by_d_alone(base_url) == alone_before + 9  # P was stopped throughout: each ended on D alone
    # P runs again: it answers the probes, /health is ok again, and new requests go through P then D.
    assert wait_until(lambda: healthy(base_url), HEALTHY_AGAIN_S, 0.5)
    assert reference_text(base_url, path, degraded_body(9)) == waited.json()["generated_text"]
    assert served_by_d_alone(base_url) == alone_before + 9
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd", 120)


def kv_fetches_failed(url: str, cause: str) -> float:
    return pd_metric(url, "pdserve_kv_transfers_failed", f'cause="{cause}"')


@contextlib.contextmanager
def kv_fetches_hung():
    """Every D replica's next KV fetch hangs (its fault hook: a stuck link); disarmed on the way out."""
    names = sorted(decode_replicas())
    for name in names:
        call_replica(name, "hang_next_fetch", 3600.0)
    try:
        yield
    finally:
        for name in names:
            call_replica(name, "hang_next_fetch", 0.0)


def fetch_held(url: str) -> bool:
    """A KV fetch is in flight on a D replica (read from each replica), and /metrics shows one."""
    held = sum(call_replica(name, "kv_transfers")["in_flight"] for name in sorted(decode_replicas()))
    return held >= 1 and pd_metric(url, "pdserve_kv_transfers_in_flight") >= 1


@pytest.mark.slow
def test_a_kv_fetch_that_never_ends_is_cut_at_its_deadline_and_the_request_completes(base_url):
    """D's fetch of P's KV hangs (issue 55 item 4): /metrics shows it in flight while held; it is
    cut kv_lease_s after its start (counted under cause="deadline"), the request moves, through P
    again, and completes with the text the same request gives without the fault; nothing is held after."""
    path = "/infer_token"
    body = {"input_id": [1, 500, 501, 502],
            "parameters": {"max_new_tokens": 8, "ignore_eos": True, "do_sample": False, "details": True}}
    cut_before, migrated_before = kv_fetches_failed(base_url, "deadline"), migrations(base_url)
    with kv_fetches_hung(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{base_url}{path}", json=body, timeout=120)
        assert wait_until(lambda: fetch_held(base_url), 60, 0.1)  # the fault happened: a fetch is held
        answer = answer.result()
    assert answer.status_code == 200 and answer.json()["details"]["generated_tokens"] == 8, answer.text
    assert wait_until(lambda: kv_fetches_failed(base_url, "deadline") > cut_before, 30, 0.2)  # as the probes say
    assert migrations(base_url) > migrated_before
    assert answer.json()["generated_text"] == reference_text(base_url, path, body)
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd", 120)


@pytest.mark.slow
def test_a_client_that_leaves_while_its_kv_fetch_is_in_flight_cancels_it_and_leaves_nothing_held(base_url):
    """D's fetch hangs with the request's first token already streamed; the client leaves: the fetch
    is cancelled (counted under cause="cancelled"), no replica holds anything for the request, and
    the next request is served."""
    path = "/infer_token"
    body = {"input_id": [1, 600, 601, 602], "stream": True,
            "parameters": {"max_new_tokens": 8, "ignore_eos": True, "do_sample": False, "details": True}}
    cancelled_before = kv_fetches_failed(base_url, "cancelled")
    with kv_fetches_hung():
        with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: closing it would close the stream
            next(line for line in lines if line.startswith("data: "))  # P's first token
            assert wait_until(lambda: fetch_held(base_url), 60, 0.1)  # D is fetching the KV, held
        # the client has gone, the fetch still held
        assert wait_until(lambda: kv_fetches_failed(base_url, "cancelled") > cancelled_before, 60, 0.2)
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd", 120)
    eventually_ok(base_url)


@pytest.mark.slow
def test_the_one_colocated_replica_killed_mid_stream_the_stream_waits_and_completes(base_url):
    path, body = bodies(True)[3]  # MindIE, seeded sampling
    before = migrations(f"{base_url}/co")
    with httpx.stream("POST", f"{base_url}/co{path}", json=body, timeout=300) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = events_of(next(line for line in lines if line.startswith("data: ")) for _ in range(5))
        (engine,) = processes("LLMServer", "co")
        sigkill(engine)  # Serve restarts it; the stream waits for the new replica
        events = first + events_of(lines)
    assert migrations(f"{base_url}/co") > before
    assert text_of(path, events) == reference_text(f"{base_url}/co", path, body)


@pytest.mark.slow
@pytest.mark.parametrize("held", ["PrefillServer", "DecodeServer"])
def test_a_client_that_leaves_while_queued_or_in_transfer_leaves_nothing_held(base_url, held):
    """P held still: the request is queued for P when its client leaves. D held still: P has
    replied and the KV waits for D (in transfer) when the client leaves. Then the role runs
    again, and no engine holds anything for the request."""
    path, body = bodies(True)[2]
    body = {**body, "input_id": [1, 70, 71, 72]}
    with stopped(held):
        if held == "PrefillServer":  # no answer can come: the client gives up while the request waits for P
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base_url}{path}", json=body, timeout=httpx.Timeout(60, read=3))
        else:
            with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=300) as response:
                assert response.status_code == 200  # P's first token is here: the request is between P and D
                next(line for line in response.iter_lines() if line.startswith("data: "))
        # the client has gone
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd", 120)  # every replica, each read directly
    eventually_ok(base_url)


HANG_S = 10  # D's steps held while Serve starts the drain (below step_timeout_s: heartbeats go on, no stall)


@pytest.mark.slow
def test_decode_scaled_down_mid_stream_its_streams_move_with_their_kv(base_url, reference_texts):
    """Last (it leaves one D): "pd" redeployed with one D replica of two while four streams run on
    both. Serve drains one; it hands each running request (KV, tokens so far, sampler state) to the
    other, which goes on from it: every stream completes unbroken with the fault-free text (greedy
    and seeded), the moves are counted, no token is replayed (no migration) and no prompt token is
    computed again, on P or D; the drained D ends, and nothing stays held. Both D's steps are held until Serve has begun the
    drain, so that the streams are still running when it does (the drained D sees it at once, and
    moves its requests between the held step and the next)."""
    before = {"migrations": migrations(base_url), "moved": pd_metric(base_url, "pdserve_kv_moves", 'event="choices"')}
    with streams_running(base_url) as (texts, fault_done):
        def running_on() -> dict[str, int]:
            return {name: call_replica(name, "holdings")["requests"] for name in sorted(decode_replicas())}
        # A stream may still be between P and D (its KV in flight) when its five events are read: wait
        # (bounded) until all four run on a D.
        wait_until(lambda: sum(running_on().values()) == 4, 30, 0.2)
        on = running_on()
        assert len(on) == 2 and all(on.values()), on  # the router spreads four streams over both
        computed = {name: call_replica(name, "stats").prompt_tokens_computed for name in on}
        computed_on_p = work_done("PrefillServer", "pd")["prompt_tokens_computed"]
        for name in on:
            call_replica(name, "hang_next_step", HANG_S)
        deploy({"pd": the_pd_app(1)}, {"pd": "/"})  # Serve stops one D: it drains
        # In place: one D leaves Serve's names as its drain begins (it cannot be called by name any
        # more), the other runs on; none is replaced.
        assert wait_until(lambda: len(decode_replicas()) == 1, HANG_S, 0.2), decode_replicas()
        (kept,) = decode_replicas() & set(on)
        (drained,) = set(on) - {kept}
        fault_done.set()
        streamed = [t.result(timeout=300) for t in texts]
        assert work_done("PrefillServer", "pd")["prompt_tokens_computed"] == computed_on_p
        assert call_replica(kept, "stats").prompt_tokens_computed == computed[kept]
    assert pd_metric(base_url, "pdserve_kv_moves", 'event="choices"') - before["moved"] == on[drained]
    assert pd_metric(base_url, "pdserve_kv_moves", 'event="failed"') == 0
    assert pd_metric(base_url, "pdserve_kv_moves", 'event="bytes"') > 0
    assert migrations(base_url) == before["migrations"]  # moved, not replayed
    assert streamed == reference_texts
    def states() -> dict[str, int]:
        return {state: n for state, n in serve.status().applications["pd"].deployments["DecodeServer"]
                .replica_states.items() if n}

    assert wait_until(lambda: states() == {"RUNNING": 1}, REPLICA_RESTART_S, 0.5), states()  # the drained D ended
    assert decode_replicas() == {kept}
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd", 120)
    eventually_ok(base_url)  # serving goes on with the one D
