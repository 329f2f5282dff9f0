"""The Batch API's runner (deployments/ingress/batch_runner.py) round by round, as the ingress runs it:
nothing asked of the engines while no batch is unfinished, a claimed batch driven to its end, the lines
in flight halved while interactive requests wait and grown back by one a round once none does, and a
batch refused at validation failed with the time and the reasons, one past its window expired, and
the lines sent to the batch's endpoint under its key, never more in flight than allowed. Written for the survivors of
`make mutants`'s batch part (docs/testing.md); tests/test_batch_lines.py drives single batches."""

import asyncio
import json
import time

from deployments.ingress.batch_runner import MIN_IN_FLIGHT, BatchRunner
from deployments.ingress.batch_store import BatchStore
from dialects.batches_api import CreateBatchRequest, new_batch
from tests.test_batch_lines import OK, ask, stored_batch


class Engines:
    """The runner's send (every line answered OK) and probe (``waiting`` interactive requests)."""

    def __init__(self) -> None:
        self.waiting, self.probes, self.sent = 0, 0, 0

    async def send(self, endpoint, body, key_name):
        self.sent += 1
        return OK[0], OK[1], None

    async def probe(self):
        self.probes += 1
        return self.waiting


def runner(store: BatchStore, engines: Engines, max_in_flight: int = 8) -> BatchRunner:
    return BatchRunner(store, engines.send, engines.probe, "me", max_in_flight=max_in_flight, lease_s=60.0,
                       poll_s=0.01)


def test_no_unfinished_batch_asks_nothing_of_the_engines(tmp_path):
    engines = Engines()
    asyncio.run(runner(BatchStore(tmp_path), engines)._round())
    assert engines.probes == 0


def test_a_round_drives_its_claimed_batch_to_the_end_and_paces_by_the_engines_queue(tmp_path):
    store, batch = stored_batch(tmp_path, [ask("a"), ask("b"), ask("c")])
    engines = Engines()
    driver = runner(store, engines)

    async def rounds():
        engines.waiting = 2
        allowed = []
        for _ in range(4):  # interactive requests wait: halved each round, down to the floor
            await driver._round()
            allowed.append(driver.allowed)
        while store.batch(batch["id"])["status"] != "completed":
            await asyncio.sleep(0.01)
        engines.waiting = 0
        store.add_batch(new_batch(CreateBatchRequest(input_file_id="none", endpoint="/v1/chat/completions",
                                                     completion_window="24h"), "batch_second"), "default")
        await driver._round()  # none waits: one more a round
        allowed.append(driver.allowed)
        return allowed

    assert asyncio.run(rounds()) == [4, 2, MIN_IN_FLIGHT, MIN_IN_FLIGHT, MIN_IN_FLIGHT + 1]
    assert engines.sent == 3 and store.batch(batch["id"])["request_counts"]["completed"] == 3


def test_the_lines_in_flight_grow_back_to_the_bound_and_no_further(tmp_path):
    store, _ = stored_batch(tmp_path, [ask("a")])
    engines = Engines()
    driver = runner(store, engines, max_in_flight=3)
    driver.allowed = 1

    async def rounds():
        seen = []
        for _ in range(4):
            await driver._round()
            seen.append(driver.allowed)
        return seen

    assert asyncio.run(rounds()) == [2, 3, 3, 3]


def test_a_batch_refused_at_validation_is_failed_with_its_time_and_reasons(tmp_path):
    store = BatchStore(tmp_path)
    batch = store.add_batch(new_batch(CreateBatchRequest(input_file_id="file-missing", endpoint="/v1/chat/completions",
                                                         completion_window="24h")), "default")
    before = int(time.time())
    asyncio.run(runner(store, Engines()).drive(batch["id"]))
    failed = store.batch(batch["id"])
    assert failed["status"] == "failed" and before <= failed["failed_at"] <= int(time.time())
    assert failed["errors"] == {"object": "list", "data": [
        {"code": "invalid_file", "message": "input_file_id: no file 'file-missing'", "param": "input_file_id",
         "line": None}]}


def test_a_batch_cancelled_while_it_was_validated_stays_cancelled(tmp_path):
    store = BatchStore(tmp_path)
    batch = store.add_batch(new_batch(CreateBatchRequest(input_file_id="file-missing", endpoint="/v1/chat/completions",
                                                         completion_window="24h")), "default")
    store.update(batch["id"], status="cancelled")
    driver = runner(store, Engines())
    assert driver._fail(store.batch(batch["id"]), [{"code": "invalid_file"}])["status"] == "cancelled"
    assert store.batch(batch["id"])["errors"] is None


def test_a_batch_past_its_window_expires_with_each_unsent_line_in_its_error_file(tmp_path):
    store, batch = stored_batch(tmp_path, [ask("a"), ask("b")])
    store.start(batch["id"], [("a", {}), ("b", {})])
    store.update(batch["id"], expires_at=int(time.time()) - 1)
    engines = Engines()
    asyncio.run(runner(store, engines).drive(batch["id"]))
    expired = store.batch(batch["id"])
    assert engines.sent == 0 and expired["status"] == "expired" and expired["expired_at"] >= expired["expires_at"]
    assert expired["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    errors = [json.loads(line) for line in store.content(expired["error_file_id"]).decode().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("a", "batch_expired"), ("b", "batch_expired")]
    assert expired["output_file_id"] is None


def test_lines_go_to_the_batchs_endpoint_under_its_key_never_more_in_flight_than_allowed(tmp_path):
    store, batch = stored_batch(tmp_path, [ask(c) for c in "abcdef"])
    calls, in_flight, most = [], [0], [0]

    async def send(endpoint, body, key_name):
        calls.append((endpoint, key_name))
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.02)
        in_flight[0] -= 1
        return OK[0], OK[1], None

    driver = BatchRunner(store, send, Engines().probe, "me", max_in_flight=2, lease_s=60.0, poll_s=0.01)
    before = int(time.time())
    asyncio.run(driver.drive(batch["id"]))
    done = store.batch(batch["id"])
    assert calls == [("/v1/chat/completions", "default")] * 6 and most[0] == 2
    assert done["status"] == "completed" and before <= done["finalizing_at"] <= done["completed_at"]
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0} and driver.in_flight == 0
