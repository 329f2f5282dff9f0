"""What a batch's owner reads back once the runner (deployments/ingress/batch_runner.py) has ended it: the
output and error files named after the batch (the same ids when finalizing runs again), a cancel that
ends the lines in flight and writes every unanswered line as batch_cancelled, an input file that is not
UTF-8 failing the batch by name; and the store's (deployments/ingress/batch_store.py) directory as
docs/operations.md lays it out, made with its parents, unknown ids answered None, in_progress_at set
when the lines are stored. Written for the survivors of `make mutants`'s batch part (docs/testing.md)."""

import asyncio
import json
import time

import pytest

from deployments.ingress.batch_runner import BatchRunner
from deployments.ingress.batch_store import BatchStore
from dialects.batches_api import CreateBatchRequest, new_batch
from dialects.files_api import file_object
from tests.test_batch_lines import CHAT, OK, REFUSED, ask, no_queue, stored_batch
from tests.test_batch_runner_answers import within_bound


def lines_of(store: BatchStore, file_id: str) -> list[dict]:
    return [json.loads(line) for line in store.content(file_id).decode().splitlines()]


def test_a_finished_batch_names_its_output_and_error_files_after_itself(tmp_path):
    store, batch = stored_batch(tmp_path, [ask("a"), ask("b"), ask("c")])

    async def send(endpoint, body, key_name):
        answer = REFUSED if body["messages"][0]["content"] == "b" else OK
        return answer[0], answer[1], None

    runner = BatchRunner(store, send, no_queue, "me", max_in_flight=4, lease_s=60.0, poll_s=0.01)
    within_bound(runner.drive(batch["id"]))
    done, stem = store.batch(batch["id"]), batch["id"].removeprefix("batch_")
    assert done["status"] == "completed"
    assert (done["output_file_id"], done["error_file_id"]) == (f"file-{stem}-output", f"file-{stem}-errors")
    for file_id, suffix, custom_ids in ((done["output_file_id"], "output", ["a", "c"]),
                                        (done["error_file_id"], "errors", ["b"])):
        doc = store.file(file_id)
        assert (doc["filename"], doc["purpose"]) == (f"{batch['id']}_{suffix}.jsonl", "batch_output")
        assert doc["bytes"] == len(store.content(file_id))
        assert [line["custom_id"] for line in lines_of(store, file_id)] == custom_ids
    before = [f["id"] for f in store.files(None, None, 10, newest_first=False)[0]]
    runner._write_files(batch["id"])  # finalizing again (after a restart): the same files, rewritten
    assert [f["id"] for f in store.files(None, None, 10, newest_first=False)[0]] == before
    assert store.batch(batch["id"])["output_file_id"] == f"file-{stem}-output"


@pytest.mark.parametrize("max_in_flight, sent_before_the_cancel", [(1, ["a"]), (4, ["a", "b", "c"])])
def test_a_cancel_ends_the_lines_in_flight_and_writes_each_unanswered_line_as_batch_cancelled(
        tmp_path, max_in_flight, sent_before_the_cancel):
    """Lines in flight (their sends cancelled: the engines free their KV) and lines not sent yet both end
    in the error file as batch_cancelled; the batch ends cancelled when the drive returns."""
    store, batch = stored_batch(tmp_path, [ask("a"), ask("b"), ask("c")])
    sent, cancelled = [], []

    async def send(endpoint, body, key_name):  # never answers: the engines are busy
        custom_id = body["messages"][0]["content"]
        sent.append(custom_id)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(custom_id)
            raise

    async def cancel_midway():
        runner = BatchRunner(store, send, no_queue, "me", max_in_flight=max_in_flight, lease_s=60.0, poll_s=0.01)
        drive = asyncio.create_task(runner.drive(batch["id"]))
        while len(sent) < len(sent_before_the_cancel):
            await asyncio.sleep(0.01)
        store.update(batch["id"], ("validating", "in_progress"), status="cancelling", cancelling_at=int(time.time()))
        await drive
        return runner

    runner = within_bound(cancel_midway())
    done = store.batch(batch["id"])
    assert sent == sent_before_the_cancel and sorted(cancelled) == sent and runner.in_flight == 0
    assert done["status"] == "cancelled" and done["cancelled_at"] >= done["cancelling_at"]
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3} and done["output_file_id"] is None
    written = lines_of(store, done["error_file_id"])
    assert [(line["custom_id"], line["response"], line["error"]["code"]) for line in written] == [
        ("a", None, "batch_cancelled"), ("b", None, "batch_cancelled"), ("c", None, "batch_cancelled")]


def test_an_input_file_that_is_not_utf8_fails_the_batch_naming_the_file(tmp_path):
    store = BatchStore(tmp_path)
    store.add_file(file_object("file-in", "in.jsonl", "batch", 3), b"\xff\xfe{")
    batch = store.add_batch(new_batch(CreateBatchRequest(input_file_id="file-in", endpoint=CHAT,
                                                         completion_window="24h")), "default")
    before = int(time.time())
    within_bound(BatchRunner(store, no_queue, no_queue, "me", 1, 60.0).drive(batch["id"]))
    failed = store.batch(batch["id"])
    assert failed["status"] == "failed" and before <= failed["failed_at"] <= int(time.time())
    assert failed["errors"] == {"object": "list", "data": [
        {"code": "invalid_file", "message": "the input file is not UTF-8", "param": "input_file_id", "line": None}]}


def test_the_store_makes_its_directory_with_its_parents_as_laid_out_and_answers_unknown_ids_none(tmp_path):
    directory = tmp_path / "batch_dir" / "app"  # neither exists yet: a first start
    store = BatchStore(directory)
    store.add_file(file_object("file-1", "in.jsonl", "batch", 3), b"{}\n")
    assert (directory / "pdserve.sqlite3").is_file() and (directory / "files" / "file-1").read_bytes() == b"{}\n"
    assert store.batch("batch_unknown") is None and store.file("file-unknown") is None


def test_a_batch_is_in_progress_from_the_moment_its_lines_are_stored(tmp_path):
    store, batch = stored_batch(tmp_path, [ask("a")])
    before = int(time.time())
    store.start(batch["id"], [("a", {})])
    started = store.batch(batch["id"])
    assert started["status"] == "in_progress" and before <= started["in_progress_at"] <= int(time.time())
