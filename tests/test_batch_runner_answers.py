"""The Batch API's runner (deployments/ingress/batch_runner.py) on what a batch's owner reads back: the
error file's line for a send that failed without an HTTP answer, 2xx answers in the output file and
every other in the error file, each line sent once while a round comes again during a drive, the
lines in flight halved to a whole number, and a 429/503 sent again after its Retry-After (never sooner
than the floor). Every drive here is bounded: a runner that stops answering or loops fails the test in
BOUND_S rather than hanging the suite. Written for the survivors of `make mutants`'s batch part
(docs/testing.md); tests/test_batch_lines.py and tests/test_batch_runner_rounds.py have its other rules."""

import asyncio
from collections import Counter

from deployments.ingress import batch_runner
from deployments.ingress.batch_runner import RETRY_FLOOR_S, BatchRunner
from deployments.ingress.batch_store import COMPLETED, FAILED
from tests.test_batch_lines import OK, ask, no_queue, stored_batch

BOUND_S = 10.0  # a batch of a few lines ends in well under a second; a stuck runner fails here


def within_bound(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, BOUND_S))


def drive(tmp_path, lines: list[str], answer):
    """A batch of ``lines`` driven to its end, two lines in flight at most, ``answer(custom_id)`` giving
    each line's (status, body) or raising: the store and the batch (none in flight after it)."""
    store, batch = stored_batch(tmp_path, lines)

    async def send(endpoint, body, key_name):
        status, reply = answer(body["messages"][0]["content"])
        return status, reply, None

    runner = BatchRunner(store, send, no_queue, "me", max_in_flight=2, lease_s=60.0, poll_s=0.01)
    within_bound(runner.drive(batch["id"]))
    assert runner.in_flight == 0
    return store, store.batch(batch["id"])


def test_a_line_whose_send_fails_is_answered_500_internal_error_in_the_error_file(tmp_path):
    def fails(custom_id):
        raise RuntimeError("not an HTTP answer")

    store, batch = drive(tmp_path, [ask("a"), ask("b")], fails)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    failed = store.results(batch["id"], FAILED)
    assert [f["custom_id"] for f in failed] == ["a", "b"]
    assert failed[0]["response"]["status_code"] == 500 and failed[0]["error"] is None
    assert failed[0]["response"]["body"] == {"error": {
        "message": "the server failed while running this line; its log has the cause under the batch's id",
        "type": "server_error", "param": None, "code": "internal_error"}}


def test_a_2xx_answer_goes_to_the_output_file_and_any_other_to_the_error_file(tmp_path):
    statuses = {"a": 200, "b": 299, "c": 300, "d": 199}
    store, batch = drive(tmp_path, [ask(c) for c in statuses], lambda custom_id: (statuses[custom_id], OK[1]))
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert [r["custom_id"] for r in store.results(batch["id"], COMPLETED)] == ["a", "b"]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in store.results(batch["id"], FAILED)] == [
        ("c", 300), ("d", 199)]


def test_a_round_during_a_drive_leaves_the_batch_to_it_and_sends_no_line_twice(tmp_path):
    """The runner's rounds come every poll_s while a batch is driven: a batch whose drive still runs is
    not driven a second time (which would send its lines in flight again: each billed twice)."""
    store, batch = stored_batch(tmp_path, [ask("a"), ask("b")])
    sent = Counter()

    async def rounds():
        answered = asyncio.Event()

        async def send(endpoint, body, key_name):
            sent[body["messages"][0]["content"]] += 1
            await answered.wait()
            return OK[0], OK[1], None

        runner = BatchRunner(store, send, no_queue, "me", max_in_flight=4, lease_s=60.0, poll_s=0.01)
        await runner._round()
        while sum(sent.values()) < 2:  # both lines in flight
            await asyncio.sleep(0.01)
        await runner._round()  # the batch is still being driven
        await asyncio.sleep(0.05)
        answered.set()
        while store.batch(batch["id"])["status"] != "completed":
            await asyncio.sleep(0.01)

    within_bound(rounds())
    assert sent == {"a": 1, "b": 1}
    assert store.batch(batch["id"])["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


async def answered_ok(endpoint, body, key_name):
    return OK[0], OK[1], None


def test_the_lines_in_flight_are_halved_to_a_whole_number(tmp_path):
    """An odd allowance halves down (5 -> 2), not to 2.5 (which lets a third line in flight)."""
    store, _ = stored_batch(tmp_path, [ask("a")])

    async def waiting():
        return 3

    runner = BatchRunner(store, answered_ok, waiting, "me", max_in_flight=5, lease_s=60.0, poll_s=0.01)

    async def one_round():
        await runner._round()
        return runner.allowed

    allowed = within_bound(one_round())
    assert allowed == 2 and isinstance(allowed, int)


def test_a_line_refused_429_or_503_is_sent_again_after_its_retry_after_never_sooner_than_the_floor(
        tmp_path, monkeypatch):
    """The waits between sends are read from the runner's calls to asyncio.sleep (none really waited)."""
    store, _ = stored_batch(tmp_path, [ask("a")])
    slept, real_sleep = [], asyncio.sleep

    async def recorded_sleep(seconds):
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(batch_runner.asyncio, "sleep", recorded_sleep)
    answers = iter([(429, {}, 2.5), (503, {}, None), (429, {}, 0.1), OK + (None,)])

    async def send(endpoint, body, key_name):
        return next(answers)

    retried = []
    runner = BatchRunner(store, send, no_queue, "me", max_in_flight=1, lease_s=60.0, on_retry=retried.append)
    assert within_bound(runner._sent_once("/v1/chat/completions", {"messages": []}, "default")) == OK
    assert slept == [2.5, RETRY_FLOOR_S, RETRY_FLOOR_S] and retried == [429, 503, 429]
