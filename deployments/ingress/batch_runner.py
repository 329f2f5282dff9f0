"""Drains the Batch API's batches through the serving path, below interactive work.

Each ingress replica runs one ``BatchRunner``. Every ``poll_s`` it claims the unfinished batches
whose lease is its own or has run out (deployments/ingress/batch_store.py) and drives each:

    validating   read the input file, check every line (dialects/batches_api.py): all good, the
                 lines are stored and the batch is in_progress; one bad, failed with the errors
    in_progress  send the pending lines, each as the HTTP request it describes, to this replica's
                 own app in process (``send``): the same routes, validation, admission, per-key
                 limits and PD path as a client's request, answered whole; each answer committed once.
                 A line the endpoint refuses (its 4xx: a body out of range, a model not served)
                 ends in the error file with that answer and counts in request_counts.failed;
                 the other lines run on
    finalizing   the output and error files written from the committed answers; completed
    cancelling   the lines in flight cancelled (the engines free their KV), the lines not run
                 written as batch_cancelled; cancelled
    expired      past expires_at: as cancelling, with batch_expired

Priority and pacing: batch lines run at priority 5 as background requests (``Origin.background``,
set by the sender): the engines run them only in steps no interactive request is in, whatever its
priority, holding them (KV kept) while one waits or runs (engine/scheduler.py). So they take the
capacity interactive traffic leaves, step by step. The runner sends no new line while an
interactive request runs through its ingress (``busy``): a line sent then takes this ingress's
time and, on a replica the interactive request is not on (P while it decodes on D), engine time
on the host's cores; the lines already in flight wait in the engines. And it keeps them from filling the engines' seats and
blocks when interactive traffic does: it reads the engines' queues (``probe``:
interactive requests waiting at any P, D or colocated replica) and, while any waits, halves how
many lines it keeps in flight (down to ``MIN_IN_FLIGHT``, so that a batch always ends); while none
waits it adds one per poll up to ``max_in_flight``.

Each line is sent once. Only an answer of 429 (its key's limits) or 503 (overloaded, not ready)
sends it again, after its Retry-After: each such retry is counted (``on_retry``, the metric
pdserve_batch_line_retries_total). A send that fails without an HTTP answer (a defect) ends the
line in the error file with a 500, rather than sending it again into engines that may have run it.
A line whose body carries a field no batch line may (``stream``, ``priority``) is refused without
being sent, with the 400 the route would give.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

from deployments.ingress.batch_store import COMPLETED, FAILED, BatchStore
from dialects.batches_api import body_refusal, check_lines, output_line, unanswered_line
from dialects.errors import error_body
from dialects.files_api import OUTPUT_PURPOSE, file_object

logger = logging.getLogger("ray.serve")

# send(endpoint, body, key_name) -> (status, JSON body, Retry-After seconds or None)
Send = Callable[[str, dict, str], Awaitable[tuple[int, dict, float | None]]]
Probe = Callable[[], Awaitable[int]]  # interactive requests waiting in the engines now
Busy = Callable[[], bool]  # whether interactive requests run through this ingress now
OnRetry = Callable[[int], None]  # a line sent again after this status
MIN_IN_FLIGHT = 1
RETRIED_STATUSES = (429, 503)  # the line waits and is sent again
RETRY_FLOOR_S = 0.5
BUSY_POLL_S = 0.02  # how soon after the last interactive request ends the next line is sent


class BatchRunner:
    def __init__(self, store: BatchStore, send: Send, probe: Probe, owner: str, max_in_flight: int,
                 lease_s: float, poll_s: float = 0.5, on_retry: OnRetry = lambda status: None,
                 busy: Busy = lambda: False) -> None:
        self.store, self.send, self.probe, self.owner, self.busy = store, send, probe, owner, busy
        self.on_retry = on_retry
        self.max_in_flight, self.lease_s, self.poll_s = max_in_flight, lease_s, poll_s
        self.allowed = max_in_flight  # lines in flight the pacing allows now
        self.in_flight = 0
        self._driving: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        """Forever: claim, pace, drive. Errors of one round are logged, the next round goes on."""
        while True:
            try:
                await self._round()
            except Exception:
                logger.exception("batch runner: round failed")
            await asyncio.sleep(self.poll_s)

    async def _round(self) -> None:
        """Claim and drive; the engines are asked for their queues only while a batch runs."""
        if not self.store.unfinished():
            return
        for batch_id in self.store.claim(self.owner, self.lease_s):
            task = self._driving.get(batch_id)
            if task is None or task.done():
                self._driving[batch_id] = asyncio.create_task(self.drive(batch_id))
        self._driving = {b: t for b, t in self._driving.items() if not t.done()}
        if self._driving:
            waiting = await self.probe()
            self.allowed = (max(MIN_IN_FLIGHT, self.allowed // 2) if waiting
                            else min(self.max_in_flight, self.allowed + 1))

    async def drive(self, batch_id: str) -> None:
        """Take the batch from where the store says it is to a final status; a failure is logged
        and the next round drives it again from where the store says it is."""
        try:
            await self._drive(batch_id)
        except Exception:
            logger.exception("batch %s: driving it failed; going on at the next round", batch_id)

    async def _drive(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if batch["status"] == "validating":
            batch = await self._validate(batch)
        if batch["status"] == "in_progress":
            batch = await self._run_lines(batch)
        if batch["status"] in ("finalizing", "cancelling"):
            self._finalize(batch)

    async def _validate(self, batch: dict) -> dict:
        if self.store.file(batch["input_file_id"]) is None:
            errors = [{"code": "invalid_file", "message": f"input_file_id: no file {batch['input_file_id']!r}",
                       "param": "input_file_id", "line": None}]
            return self._fail(batch, errors)
        try:
            text = self.store.content(batch["input_file_id"]).decode("utf-8")
        except UnicodeDecodeError:
            return self._fail(batch, [{"code": "invalid_file", "message": "the input file is not UTF-8",
                                       "param": "input_file_id", "line": None}])
        # In a thread: 50,000 lines take seconds, which the ingress's event loop must not wait out.
        requests, errors = await asyncio.to_thread(check_lines, text, batch["endpoint"])
        if errors:
            return self._fail(batch, errors)
        self.store.start(batch["id"], requests)
        return self.store.batch(batch["id"])

    def _fail(self, batch: dict, errors: list[dict]) -> dict:
        return self.store.update(batch["id"], ("validating",), status="failed", failed_at=int(time.time()),
                                 errors={"object": "list", "data": errors}) or self.store.batch(batch["id"])

    async def _run_lines(self, batch: dict) -> dict:
        """Send the pending lines, paced, until all are answered, the batch is cancelled, or it expires."""
        batch_id, endpoint, key_name = batch["id"], batch["endpoint"], self.store.key_name(batch["id"])
        tasks: set[asyncio.Task] = set()
        try:
            # Again while lines are pending: one whose send raised (logged) is sent again.
            while (pending := self.store.pending(batch_id)) and not self._stopping(batch_id):
                for line, custom_id, body in pending:
                    while self.in_flight >= self.allowed and not self._stopping(batch_id):
                        await asyncio.sleep(self.poll_s / 5)
                    while self.busy() and not self._stopping(batch_id):
                        await asyncio.sleep(BUSY_POLL_S)
                    if self._stopping(batch_id):
                        break
                    self.in_flight += 1
                    task = asyncio.create_task(self._answer(batch_id, line, custom_id, endpoint, body, key_name))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks and not self._stopping(batch_id):
                    await asyncio.wait(tasks, timeout=self.poll_s)
        finally:
            for task in tasks:
                task.cancel()  # a cancelled line's request is cancelled in the engines, its KV freed
            await asyncio.gather(*tasks, return_exceptions=True)
        status = self.store.batch(batch_id)["status"]
        if status == "in_progress" and time.time() >= batch["expires_at"]:
            return self._end_unanswered(batch_id, "batch_expired", "expired")
        if status == "in_progress":
            return self.store.update(batch_id, ("in_progress",), status="finalizing",
                                     finalizing_at=int(time.time())) or self.store.batch(batch_id)
        return self.store.batch(batch_id)

    def _stopping(self, batch_id: str) -> bool:
        batch = self.store.batch(batch_id)
        return batch["status"] != "in_progress" or time.time() >= batch["expires_at"]

    async def _answer(self, batch_id: str, line: int, custom_id: str, endpoint: str, body: dict,
                      key_name: str) -> None:
        try:
            status, answer = await self._sent_once(endpoint, body, key_name)
        except Exception:  # not an HTTP answer (a defect): the line fails, it is not sent twice
            logger.exception("batch %s: line %d was not answered", batch_id, line)
            status, answer = 500, error_body(500, "the server failed while running this line; its log has the "
                                                  "cause under the batch's id", None, "internal_error")
        finally:
            self.in_flight -= 1
        state = COMPLETED if 200 <= status < 300 else FAILED
        self.store.record(batch_id, line, state, output_line(custom_id, status, answer))

    async def _sent_once(self, endpoint: str, body: dict, key_name: str) -> tuple[int, dict]:
        """The line's answer: sent once, again only after a 429 or 503 (each retry counted); a body
        no batch line may carry is answered 400 without being sent."""
        if (refusal := body_refusal(body)) is not None:
            return 400, refusal
        while True:
            status, answer, retry_after = await self.send(endpoint, body, key_name)
            if status not in RETRIED_STATUSES:
                return status, answer
            self.on_retry(status)
            await asyncio.sleep(max(retry_after or 0.0, RETRY_FLOOR_S))

    def _end_unanswered(self, batch_id: str, code: str, status: str) -> dict:
        for line, custom_id, _ in self.store.pending(batch_id):
            self.store.record(batch_id, line, FAILED, unanswered_line(custom_id, code))
        self._write_files(batch_id)
        return self.store.update(batch_id, None, status=status, **{f"{status}_at": int(time.time())})

    def _finalize(self, batch: dict) -> None:
        if batch["status"] == "cancelling":
            self._end_unanswered(batch["id"], "batch_cancelled", "cancelled")
            return
        self._write_files(batch["id"])
        self.store.update(batch["id"], ("finalizing",), status="completed", completed_at=int(time.time()))

    def _write_files(self, batch_id: str) -> None:
        """The output and error files, from the committed answers; their ids follow from the
        batch's, so finalizing again after a restart rewrites the same files."""
        ids = {}
        for state, suffix in ((COMPLETED, "output"), (FAILED, "errors")):
            results = self.store.results(batch_id, state)
            if not results:
                continue
            content = "".join(json.dumps(r) + "\n" for r in results).encode()
            file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
            self.store.add_file(file_object(file_id, f"{batch_id}_{suffix}.jsonl", OUTPUT_PURPOSE, len(content)),
                                content)
            ids["output_file_id" if state == COMPLETED else "error_file_id"] = file_id
        self.store.update(batch_id, None, **ids)
