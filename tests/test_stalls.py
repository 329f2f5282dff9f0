"""The stalls nothing detected before issue 30, and overload, against one PD app with two P and two D
replicas: a P replica SIGSTOPped with requests in its engine (they complete on the other P, and so do
requests sent while it is stopped; its blocks return after SIGCONT), an engine step that does not end
(the fault hook: the replica stops its heartbeats, its streams move and complete, Serve replaces it),
a burst past the admission bound in all three dialects (each request ends at once with 200 or a
clean 503 with Retry-After, in its dialect's shape), and, as the app does not degrade to P-only
decoding, every D stopped answered by a clean 503 at once and /health turning 503 once D is killed.
Its KV goes through shared memory (tests/test_faults.py's app: the object store), so a client that
leaves mid-fetch is tried over both transports.

Each fault is proven (a stopped process still runs, the migration counter moved, a replaced replica is
gone from Ray's registry). The measured detection delays are printed (``pytest -s``), not asserted:
they depend on the machine's load."""

import concurrent.futures
import time

import anthropic
import httpx
import openai
import pytest

from deployments.app import pd_app
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from tests.serving import (HEALTHY_AGAIN_S, RAY_INTERNALS, REPLICA_RESTART_S, assert_nothing_held, call_replica,
                           deploy, migrations, processes, replica_process, replicas, serve_session, sigkill, stopped,
                           wait_until, work_done)
from tests.test_faults import LONG, fault_free_texts, streams_running

APP = "stalls"
STALL_TIMEOUT_S = 3
STEP_TIMEOUT_S = 5
TOKENS_PER_REPLICA = 16000  # admission: priority 5 may have 0.6 * 2 * 16000 tokens in flight to D
BURST_MAX_TOKENS = LONG  # the app's max_iter_times: a burst request asks all it may
PROMPT = 400  # tokens of the P stall test's prompts, as in the report


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        # The engine replicas' fault hook is on (their environment only); Serve checks their health
        # every second, so a stuck step is replaced in seconds.
        options = {"num_replicas": 2, "health_check_period_s": 1, "graceful_shutdown_timeout_s": 2,
                   "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"PDSERVE_FAULT_HOOKS": "1"}}}}
        deploy({APP: pd_app({"torch_threads": 1, "max_iter_times": LONG, "embeddings": False, "dtype": "float32",
                             "kv_lease_s": 6, "stall_timeout_s": STALL_TIMEOUT_S, "step_timeout_s": STEP_TIMEOUT_S,
                             "pd_local_prefill_tokens": 0, "admission_tokens_per_replica": TOKENS_PER_REPLICA,
                             "pd_degrade_to_prefill": False, "pd_degrade_to_decode": False, "kv_transport": "shared_memory"},
                            prefill_options=options, decode_options=options)})
        url = f"{url}/{APP}"
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, HEALTHY_AGAIN_S, 1)
        yield url


def test_the_step_watchdog_reads_a_hung_step_and_only_while_it_runs():
    engine = AsyncEngine(EngineConfig(model="tiny-llama"))
    try:
        assert engine.step_running_s() == 0.0
        engine.hang_next_step(60.0)  # until end_hang: the verdict does not depend on this thread's timing
        assert wait_until(lambda: engine.step_running_s() > 1.0, 30, 0.05)  # the hung step, still running
        engine.end_hang()
        assert wait_until(lambda: engine.step_running_s() == 0.0, 30, 0.05)  # it ended: nothing running
        assert engine.is_alive()
    finally:
        engine.shutdown()


def test_the_fault_hook_is_refused_without_the_test_setting(monkeypatch):
    from deployments.replicas.servers import LLMServer

    monkeypatch.delenv("PDSERVE_FAULT_HOOKS", raising=False)
    server = LLMServer.func_or_class(EngineConfig(model="tiny-llama"), None, 1, 1.0, 0.5)
    try:
        with pytest.raises(PermissionError):
            server.hang_next_step(60)
        monkeypatch.setenv("PDSERVE_FAULT_HOOKS", "1")
        server.hang_next_step(60)  # until end_hang
        assert wait_until(lambda: not server.responsive(), 30, 0.05)  # past step_timeout_s (0.5 s)
        with pytest.raises(RuntimeError, match="step_timeout_s"):
            server.check_health()
        server.engine.end_hang()
        assert wait_until(server.responsive, 30, 0.05)
        server.check_health()
    finally:
        server.engine.shutdown()


NO_DECODE_RETRIES = 30


def completion(url: str, i: int) -> str:
    """Request ``i`` of the P stall test (a PROMPT-token prompt of its own, greedy): its text."""
    body = {"model": "tiny-llama", "prompt": [1] + [(11 * i + 7 * j) % 700 + 3 for j in range(PROMPT)],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    # This app does not degrade to P alone: on a loaded box the ingress's probes may find no D
    # answering within stall_timeout_s (3 s here) for a moment, and the answer is then a clean 503
    # that says to retry (Retry-After: 1); a client retries it, as this one does, a bounded number of times.
    for _ in range(NO_DECODE_RETRIES):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        if response.status_code != 503 or response.json()["error"]["code"] != "no_decode_replica":
            break
        time.sleep(1)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.slow
def test_a_stopped_prefill_replica_its_requests_and_new_ones_complete_on_the_other(base_url):
    """One P's next step held still 4 s (the hook, under STEP_TIMEOUT_S), so that requests it took are
    still in it when it is SIGSTOPped: accepted, not prefilled, proven by its own count of open
    streams. They move to the other P; so do requests sent while it is stopped; after SIGCONT the
    stopped P, still the same replica, frees everything."""
    expected = [completion(base_url, i) for i in range(16)]  # fault-free, greedy
    frozen = sorted(replicas("PrefillServer", APP))[0]
    process = replica_process(frozen)
    before = migrations(base_url)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        call_replica(frozen, "hang_next_step", 4.0)
        texts = [pool.submit(completion, base_url, i) for i in range(12)]
        assert wait_until(lambda: call_replica(frozen, "holdings")["streams"] > 0, 30, 0.05)
        with stopped("PrefillServer", APP, only=process):
            stopped_at = time.monotonic()
            texts += [pool.submit(completion, base_url, i) for i in range(12, 16)]  # sent to a stopped P
            done = [t.result(timeout=300) for t in texts]
            print(f"\nP stopped: its requests and 4 new ones completed {time.monotonic() - stopped_at:.2f} s "
                  f"after SIGSTOP (stall_timeout_s={STALL_TIMEOUT_S})")
            moved = migrations(base_url) - before
        assert process.is_running()  # stopped, never killed
    assert moved > 0  # the stopped P's requests were prefilled again elsewhere
    assert done == expected
    assert_nothing_held(["PrefillServer"], APP, 120)  # the stopped P, running again, freed what it held
    assert frozen in replicas("PrefillServer", APP)  # ... itself: not replaced


@pytest.mark.slow
def test_a_step_that_does_not_end_its_replica_is_replaced_and_its_streams_move_and_complete(base_url):
    expected = fault_free_texts(base_url)  # fault-free, batched together
    before = migrations(base_url)
    with streams_running(base_url) as (texts, fault_done):
        serving = {name: call_replica(name, "holdings")["streams"] for name in replicas("DecodeServer", APP)}
        stuck = max(serving, key=serving.get)
        assert serving[stuck] > 0
        call_replica(stuck, "hang_next_step", 120.0)  # bounded: Serve replaces the replica long before
        hung_at = time.monotonic()
        fault_done.set()
        assert wait_until(lambda: stuck not in replicas("DecodeServer", APP), 120, 0.2)  # Serve took it down
        replaced_s = time.monotonic() - hung_at
        streamed = [t.result(timeout=300) for t in texts]
    # The ingress's log dates each move (ReplicaStalled): step_timeout_s + stall_timeout_s after the hang.
    print(f"\nstuck step: Serve had stopped the replica {replaced_s:.2f} s after its step hung "
          f"(step_timeout_s={STEP_TIMEOUT_S}, health checks every 1 s, 3 failures)")
    assert migrations(base_url) > before  # counted as the moved streams end: they moved, and completed
    assert streamed == expected
    assert wait_until(lambda: len(replicas("DecodeServer", APP)) == 2, REPLICA_RESTART_S, 0.5)  # and started another


def burst_request(url: str, dialect: str, i: int):
    """One request of the burst, with its dialect's client: (status, Retry-After, error body or None)."""
    prompt = f"burst {i}: tell me a long story"
    if dialect == "openai":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=BURST_MAX_TOKENS,
                                      extra_body={"ignore_eos": True})
            return 200, None, None
        except openai.APIStatusError as error:
            return error.status_code, error.response.headers.get("retry-after"), error.response.json()
    if dialect == "anthropic":
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        try:
            client.messages.create(model="tiny-llama", messages=[{"role": "user", "content": prompt}],
                                   max_tokens=BURST_MAX_TOKENS)
            return 200, None, None
        except anthropic.APIStatusError as error:
            return error.status_code, error.response.headers.get("retry-after"), error.response.json()
    body = {"input_id": [1, 50 + i, 51, 52], "parameters": {"max_new_tokens": BURST_MAX_TOKENS, "ignore_eos": True}}
    response = httpx.post(f"{url}/infer_token", json=body, timeout=120)
    error = response.json() if response.status_code != 200 else None
    return response.status_code, response.headers.get("retry-after"), error


@pytest.mark.slow
def test_a_burst_past_the_admission_bound_ends_at_once_200_or_a_clean_503_in_each_dialect(base_url):
    dialects = ["openai", "mindie", "anthropic"] * 16  # ~48 * 800 tokens: past 0.6 * 2 * 16000
    with concurrent.futures.ThreadPoolExecutor(len(dialects)) as pool:
        answers = list(pool.map(lambda a: burst_request(base_url, *a), zip(dialects, range(len(dialects)))))
    refused = [(d, a) for d, a in zip(dialects, answers) if a[0] != 200]
    for dialect, (status, retry_after, error) in refused:
        assert status == 503 and retry_after == "1", (dialect, status, error)
        assert not RAY_INTERNALS.search(str(error)), error
        if dialect == "anthropic":
            assert error["type"] == "error" and error["error"]["type"] == "overloaded_error", error
        else:  # OpenAI's shape, /infer_token's too
            assert error["error"]["code"] == "overloaded" and error["error"]["type"], error
    assert refused and len(refused) < len(dialects)  # past the bound, and the bound admitted some
    print(f"\nburst: {len(dialects) - len(refused)} admitted (200), {len(refused)} refused (503, Retry-After: 1)")


def first_503(url: str, timeout_s: float) -> tuple[httpx.Response, int, float]:
    """/health polled every 0.1 s until a 503 (bounded): that answer, the polls, the seconds it took."""
    answers, start = [], time.monotonic()

    def unavailable() -> bool:
        answers.append(httpx.get(f"{url}/health", timeout=30))
        return answers[-1].status_code == 503

    assert wait_until(unavailable, timeout_s, 0.1)
    return answers[-1], len(answers), time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("role", ["DecodeServer", "PrefillServer"])
def test_without_degradation_no_replica_of_a_role_answering_is_a_clean_503_at_once(base_url, role):
    """This app degrades to neither role alone (pd_degrade_to_prefill and pd_degrade_to_decode off).
    Every replica of ``role`` SIGSTOPped: within about stall_timeout_s /health is 503 naming it, and
    new requests get a clean 503 in their dialect at once, before the other role computes anything
    (never a wait for a KV lease or a stalled call). After SIGCONT, 200."""
    kind = "decode" if role == "DecodeServer" else "prefill"
    other = "PrefillServer" if role == "DecodeServer" else "DecodeServer"
    requests = [("/infer_token", {"input_id": [1, 80, 81, 82],
                                  "parameters": {"max_new_tokens": 8, "ignore_eos": True}}),
                ("/v1/completions", {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8})]
    for path, body in requests:  # served (and the model's details known to the ingress) before the fault
        assert httpx.post(f"{base_url}{path}", json=body, timeout=60).status_code == 200
    with stopped(role, APP):
        answer, polls, seconds = first_503(base_url, 60)
        print(f"\n/health: 503 {seconds:.2f} s after every {role} was stopped ({polls} polls, every 0.1 s; "
              f"stall_timeout_s={STALL_TIMEOUT_S}, no degradation)")
        assert role in answer.json().get("deployments", {}), answer.json()

        # A failed canary or Serve's own health check may name the role first; the ingress's probes
        # say "no ... replica answers" once stall_timeout_s has passed without an answer.
        def probes_say_down() -> bool:
            body = httpx.get(f"{base_url}/health", timeout=30).json()
            return body.get("deployments", {}).get(role) == {"status": "failing",
                                                             "reason": f"no {kind} replica answers"}

        assert wait_until(probes_say_down, 60, 0.1)
        prompts_before = work_done(other, APP)["prompt_tokens_computed"]  # the canary's, if any, done
        refused = [httpx.post(f"{base_url}{path}", json=body, timeout=30) for path, body in requests]
        assert work_done(other, APP)["prompt_tokens_computed"] == prompts_before  # the other role never asked
    for response in refused:
        assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
        assert response.json()["error"]["code"] == f"no_{kind}_replica", response.text
        assert not RAY_INTERNALS.search(response.text), response.text
    assert wait_until(lambda: httpx.get(f"{base_url}/health", timeout=30).status_code == 200, HEALTHY_AGAIN_S, 0.5)
    assert httpx.post(f"{base_url}{requests[0][0]}", json=requests[0][1], timeout=60).status_code == 200


@pytest.mark.slow
def test_health_turns_503_once_every_decode_replica_is_killed(base_url):
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    for process in processes("DecodeServer", APP):
        sigkill(process)
    # The verdict is the body's reason below (the registry, not a canary's timeout); 180 s only ends a hang.
    answer, polls, seconds = first_503(base_url, 180)
    print(f"\n/health: 503 {seconds:.2f} s after D was killed ({polls} polls, every 0.1 s)")
    # Said by the replicas' registry, not by a canary that timed out (which would take up to FRESH_S + 5 s).
    body = answer.json()
    assert body["deployments"]["DecodeServer"] == {"status": "failing", "reason": "no live replica"}, body
    assert "canary" not in body, body
    # Serve starts new D replicas; /health says so once a canary goes through them.
    assert wait_until(lambda: httpx.get(f"{base_url}/health", timeout=30).status_code == 200, HEALTHY_AGAIN_S, 1)
