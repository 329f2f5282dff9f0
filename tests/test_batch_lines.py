"""The Batch API's parts that need no server: each kind of invalid input line refused by name and
line (dialects/batches_api.py), the upload checks (dialects/files_api.py), and the store's
guarantees (deployments/ingress/batch_store.py): a line answered once, state read back by a new store,
a batch's lease; the runner's line rules (deployments/ingress/batch_runner.py: a refused line in the
error file and the rest completed, each line sent once, a 429/503 sent again and counted), its
``send`` here a script of the answers the app gives (tests/test_batch_api.py sends them to the
served app); the rate limits' window and keys (deployments/ingress/rate_limits.py).
tests/test_batch_api.py runs batches, and the limits, through the served app."""

import asyncio
from collections import Counter
import json
import time

import pytest

from deployments.ingress.batch_runner import BatchRunner
from deployments.ingress.batch_store import COMPLETED, FAILED, BatchStore
from deployments.ingress.rate_limits import DEFAULT_KEY, RateLimits, SlidingWindow
from dialects.auth import check_api_key
from dialects.batches_api import CreateBatchRequest, check_lines, new_batch, output_line
from dialects.errors import APIError, error_body
from dialects.files_api import UploadLimits, check_upload, file_object

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def line(custom_id="a", url=CHAT, method="POST", body=None, **extra) -> str:
    body = {"model": "m", "messages": HI, "max_tokens": 4} if body is None else body
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body, **extra})


def test_valid_lines_are_read_in_order_skipping_blank_ones():
    requests, errors = check_lines("\n".join([line("a"), "", line("b")]) + "\n", CHAT)
    assert errors == []
    assert [cid for cid, _ in requests] == ["a", "b"]
    assert requests[0][1]["max_tokens"] == 4


@pytest.mark.parametrize("bad, code, param", [
    ("{not json", "invalid_json_line", None),
    ("[1, 2]", "invalid_json_line", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "missing_custom_id", "custom_id"),
    (line("a"), "duplicate_custom_id", "custom_id"),
    (line("z", method="GET"), "invalid_method", "method"),
    (line("z", url="/v1/unknown"), "invalid_url", "url"),
    (line("z", url="/v1/completions"), "invalid_url", "url"),
    (line("z", body=[1]), "invalid_request", "body"),
    (json.dumps({"custom_id": "z", "method": "POST", "url": CHAT}), "invalid_request", "body"),
    (line("z", body={"model": "other", "messages": HI}), "mixed_models", "body.model"),
    (line("z", extra_field=1), "invalid_request", "extra_field"),
])
def test_each_invalid_line_is_refused_with_its_line_and_field(bad, code, param):
    requests, errors = check_lines("\n".join([line("a"), bad, line("c")]), CHAT)
    assert [(e["code"], e["line"], e["param"]) for e in errors] == [(code, 2, param)]
    assert errors[0]["message"].startswith("line 2: ")
    assert [cid for cid, _ in requests] == ["a", "c"]


def test_a_body_the_endpoint_would_refuse_is_no_validation_error():
    """OpenAI validates the file, not the bodies: a body out of range, one without its messages, one
    asking to stream, a line with no model beside lines with one, all pass validation (each line is the
    endpoint's, or the runner's, to refuse on its own)."""
    bodies = [{"model": "m", "messages": HI, "temperature": 9}, {"model": "m", "messages": []},
              {"model": "m", "messages": HI, "stream": True}, {"messages": HI}]
    requests, errors = check_lines("\n".join(line(str(i), body=b) for i, b in enumerate(bodies)), CHAT)
    assert errors == [] and [body for _, body in requests] == bodies


def test_a_file_without_requests_is_refused():
    assert check_lines("\n\n", CHAT)[1][0]["code"] == "empty_file"


def test_create_refuses_unknown_fields_endpoints_and_windows():
    good = {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": "24h"}
    assert CreateBatchRequest.model_validate(good).endpoint == CHAT
    for wrong in ({"endpoint": "/v1/moderations"}, {"completion_window": "1h"}, {"extra": 1},
                  {"metadata": {str(i): "v" for i in range(17)}}):
        with pytest.raises(ValueError):
            CreateBatchRequest.model_validate({**good, **wrong})


@pytest.mark.parametrize("content, limits, code", [
    (b"x" * 101, UploadLimits(100, 10), "file_too_large"),
    (b"{}\n" * 11, UploadLimits(1000, 10), "too_many_lines"),
    (b"\n \n", UploadLimits(1000, 10), "empty_file"),
    (b"\xff\xfe{}", UploadLimits(1000, 10), "invalid_encoding"),
])
def test_an_upload_over_the_limits_is_refused_naming_the_file(content, limits, code):
    with pytest.raises(APIError) as refused:
        check_upload(content, limits)
    assert (refused.value.code, refused.value.param) == (code, "file")
    check_upload(b"{}\n" * 10, UploadLimits(1000, 10))  # at the limits: accepted


def test_a_line_is_answered_once_and_a_new_store_reads_everything_back(tmp_path):
    store = BatchStore(tmp_path)
    store.add_file(file_object("file-in", "in.jsonl", "batch", 3), b"{}\n")
    batch = store.add_batch(new_batch(CreateBatchRequest(input_file_id="file-in", endpoint=CHAT,
                                                         completion_window="24h")), "default")
    store.start(batch["id"], [("a", {"x": 1}), ("b", {"x": 2})])
    assert store.record(batch["id"], 0, COMPLETED, output_line("a", 200, {"first": True}))
    assert not store.record(batch["id"], 0, COMPLETED, output_line("a", 200, {"first": False}))

    again = BatchStore(tmp_path)  # as a restarted ingress finds it
    assert again.batch(batch["id"])["status"] == "in_progress"
    assert again.batch(batch["id"])["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert [cid for _, cid, _ in again.pending(batch["id"])] == ["b"]
    assert again.results(batch["id"], COMPLETED)[0]["response"]["body"] == {"first": True}
    assert again.content("file-in") == b"{}\n"


def test_a_batch_stays_with_its_driver_until_the_lease_runs_out(tmp_path):
    store = BatchStore(tmp_path)
    batch = store.add_batch(new_batch(CreateBatchRequest(input_file_id="f", endpoint=CHAT, completion_window="24h")),
                            "default")
    assert store.claim("first", lease_s=0.3) == [batch["id"]]
    assert store.claim("second", lease_s=0.3) == []
    assert store.claim("first", lease_s=0.3) == [batch["id"]]  # renewed
    time.sleep(0.4)
    assert store.claim("second", lease_s=0.3) == [batch["id"]]
    store.update(batch["id"], status="completed")
    assert store.claim("second", lease_s=0.3) == []


def stored_batch(tmp_path, lines: list[str]) -> tuple[BatchStore, dict]:
    """A store holding a batch of ``lines``, as created (validating)."""
    store = BatchStore(tmp_path)
    store.add_file(file_object("file-in", "in.jsonl", "batch", 1), "\n".join(lines).encode())
    return store, store.add_batch(new_batch(CreateBatchRequest(input_file_id="file-in", endpoint=CHAT,
                                                                completion_window="24h")), "default")


async def no_queue():
    return 0


def run_batch(tmp_path, lines: list[str], answers: dict) -> tuple[BatchStore, dict, Counter, list[int]]:
    """A batch of ``lines`` driven to its end by a runner whose ``send`` answers each custom_id with
    the next of ``answers[custom_id]`` ((status, body), or an exception to raise); the store, the
    batch, how many times each custom_id was sent and the statuses retried."""
    store, batch = stored_batch(tmp_path, lines)
    sent, retried = Counter(), []

    async def send(endpoint, body, key_name):
        custom_id = body["messages"][0]["content"]
        sent[custom_id] += 1
        answer = answers[custom_id][sent[custom_id] - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer[0], answer[1], 0.0 if answer[0] in (429, 503) else None

    runner = BatchRunner(store, send, no_queue, "me", max_in_flight=4, lease_s=10.0, poll_s=0.05,
                         on_retry=retried.append)
    asyncio.run(runner.drive(batch["id"]))
    return store, store.batch(batch["id"]), sent, retried


def ask(custom_id: str, **fields) -> str:
    """A line whose message says its custom_id (the scripted send reads it there)."""
    return line(custom_id, body={"model": "m", "messages": [{"role": "user", "content": custom_id}], **fields})


OK = (200, {"object": "chat.completion", "choices": []})
REFUSED = (400, error_body(400, "temperature: Input should be less than or equal to 2", "temperature"))
BUSY = (503, error_body(503, "engines not ready", None, "not_ready"))
LIMITED = (429, error_body(429, "rate limit reached", None, "rate_limit_exceeded"))


def test_a_refused_line_goes_to_the_error_file_and_the_others_complete(tmp_path):
    lines = [ask("a"), ask("b", temperature=9), ask("c"), ask("d", stream=True)]
    store, batch, sent, _ = run_batch(tmp_path, lines, {"a": [OK], "b": [REFUSED], "c": [OK]})
    assert batch["status"] == "completed" and batch["errors"] is None
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert sorted(r["custom_id"] for r in store.results(batch["id"], COMPLETED)) == ["a", "c"]
    errors = {r["custom_id"]: r["response"] for r in store.results(batch["id"], FAILED)}
    assert errors["b"]["status_code"] == 400 and errors["b"]["body"] == REFUSED[1]
    assert errors["d"]["status_code"] == 400 and errors["d"]["body"]["error"]["param"] == "stream"
    assert sent == {"a": 1, "b": 1, "c": 1}  # d is refused without being sent
    written = store.content(batch["error_file_id"]).decode().splitlines()
    assert sorted(json.loads(w)["custom_id"] for w in written) == ["b", "d"]


def test_each_line_is_sent_once_and_a_429_or_503_again_counted(tmp_path):
    lines = [ask("a"), ask("b"), ask("c"), ask("d")]
    answers = {"a": [OK], "b": [BUSY, OK], "c": [LIMITED, BUSY, OK], "d": [RuntimeError("not an HTTP answer")]}
    store, batch, sent, retried = run_batch(tmp_path, lines, answers)
    assert sent == {"a": 1, "b": 2, "c": 3, "d": 1}
    assert sorted(retried) == [429, 503, 503]
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    (failed,) = store.results(batch["id"], FAILED)
    assert failed["custom_id"] == "d" and failed["response"]["status_code"] == 500


def test_a_malformed_file_fails_the_batch_and_no_line_runs(tmp_path):
    lines = [ask("a"), ask("b").replace('"POST"', '"GET"'), ask("a")]
    store, batch, sent, _ = run_batch(tmp_path, lines, {})
    assert batch["status"] == "failed" and sent == {}
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [("invalid_method", 2),
                                                                        ("duplicate_custom_id", 3)]


def test_pages_of_files_follow_the_cursor(tmp_path):
    store = BatchStore(tmp_path)
    for i in range(5):
        store.add_file(file_object(f"file-{i}", "x", "batch", 1, created_at=100 + i), b"x")
    first, more = store.files(None, None, 2, newest_first=True)
    assert [f["id"] for f in first] == ["file-4", "file-3"] and more
    rest, more = store.files(None, "file-3", 10, newest_first=True)
    assert [f["id"] for f in rest] == ["file-2", "file-1", "file-0"] and not more
    assert store.delete_file("file-0") and not store.delete_file("file-0")


def test_the_window_refuses_past_rpm_and_tpm_and_says_when_there_is_room():
    now = [100.0]
    window = SlidingWindow(clock=lambda: now[0])
    assert window.admit("a", 2, None)[:2] == (0.0, None)
    now[0] = 110.0
    assert window.admit("a", 2, None)[:2] == (0.0, None)
    assert window.admit("a", 2, None)[:2] == (50.0, "rpm")  # the first leaves the window at 160
    assert window.admit("b", 2, None)[:2] == (0.0, None)  # another key: its own window
    now[0] = 160.0
    assert window.admit("a", 2, None)[:2] == (0.0, None)

    window.charge("t", 6)
    now[0] = 170.0
    window.charge("t", 6)
    assert window.admit("t", None, 10)[:2] == (50.0, "tpm")  # 12 used; room once the first 6 leave, at 220
    now[0] = 220.0
    assert window.admit("t", None, 10)[:2] == (0.0, None)


def test_a_request_is_its_listed_keys_and_listed_keys_pass_the_api_key_check():
    limits = RateLimits.model_validate({"default": {"rpm": 5}, "keys": {"team": {"key": "sk-t", "tpm": 9}}})
    assert limits.key_name({"authorization": "Bearer sk-t"}) == "team"
    assert limits.key_name({"x-api-key": "sk-t"}) == "team"
    assert limits.key_name({"authorization": "Bearer sk-else"}) == DEFAULT_KEY
    assert limits.key_name({}) == DEFAULT_KEY
    assert limits.of("team").tpm == 9 and limits.of(DEFAULT_KEY).rpm == 5
    check_api_key(["sk-main", *limits.api_keys()], {"authorization": "Bearer sk-t"})
    with pytest.raises(APIError):
        check_api_key(["sk-main", *limits.api_keys()], {"authorization": "Bearer sk-else"})
    with pytest.raises(ValueError):
        RateLimits.model_validate({"keys": {"team": {"key": "sk-t", "rpm": 0}}})


def test_no_line_is_sent_while_interactive_requests_run_and_every_line_once_they_end(tmp_path):
    """The runner's ``busy``: while interactive requests run through its ingress it sends nothing
    (the engines hold the lines in flight); once they end the batch runs to its end."""
    store, batch = stored_batch(tmp_path, [ask(c) for c in "abc"])
    events: list[str] = []
    interactive_polls = iter(range(5))  # interactive requests run for the runner's first 5 looks

    def busy() -> bool:
        running = next(interactive_polls, None) is not None
        events.append("busy" if running else "idle")
        return running

    async def send(endpoint, body, key_name):
        events.append("sent")
        return OK[0], OK[1], None

    runner = BatchRunner(store, send, no_queue, "me", max_in_flight=4, lease_s=10.0, poll_s=0.05, busy=busy)
    asyncio.run(runner.drive(batch["id"]))
    assert events[:6] == ["busy"] * 5 + ["idle"]  # the first line waited out the interactive requests
    assert events.count("sent") == 3 and "busy" not in events[events.index("sent"):]
    assert store.batch(batch["id"])["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
