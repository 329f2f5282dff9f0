"""Whether any D replica can answer: PD's degradation to P-only decoding (docs/serving.md, "No decode replica").

A D replica that is dead, SIGSTOPped or stuck in one engine step takes calls it never serves, and a
stream watch (deployments/replicas/liveness.py) only sees it through a request that waits on it. So the ingress
asks every D replica itself, every ``heartbeat_s``: ``DecodeServer.answering``, pinned to that
replica, which answers with its id while its engine thread runs and no step has run past the step
watchdog. A replica answers or not; a probe left unanswered is not sent again until it returns (a
stopped replica collects no pile of probes). A replica is *answering* while its last answer is younger
than ``stall_timeout_s``; one new to the ingress has that long to give its first. When none is (every
replica silent, dead, or none running), D is *down*: the PD backend (deployments/pd/backends.py) then
runs new requests on P as a colocated engine, moves the ones waiting for a D there, and goes back to
P then D as soon as one replica answers again.

Each answer also carries the replica's KV fetches (in flight, the oldest's age, past their deadline,
failed by cause: KVConnector.transfer_health): ``transfers`` sums them over the replicas that
answer, for /metrics and /health.

Probes go through the D deployment's own handle and request router (the ``pinned`` keyword,
deployments/pd/routing.py): the replicas probed are the ones Serve tells this process's router of.
"""

from __future__ import annotations

import asyncio
import time

from collections import Counter

from ray.serve.handle import DeploymentHandle

from deployments.pd import routing

DEPLOYMENT = "DecodeServer"


class DecodeWatch:
    """The ingress's view of which D replicas answer. Starts its probing on the first ``down()``
    call of an event loop (the ingress's, or a test's)."""

    def __init__(self, decode: DeploymentHandle, heartbeat_s: float, stall_timeout_s: float) -> None:
        self.decode, self.heartbeat_s, self.stall_timeout_s = decode, heartbeat_s, stall_timeout_s
        self.last_answer: dict[str, float] = {}  # replica id -> time.monotonic() of its last answer, or first sight
        self.fetches: dict[str, dict] = {}  # replica id -> its KV fetches, as it last answered
        self._probing: dict[str, asyncio.Task] = {}  # replica id -> its probe not answered yet
        self._task: asyncio.Task | None = None

    def answering(self) -> set[str]:
        """The D replicas Serve runs that answered within ``stall_timeout_s`` (or were first seen then)."""
        running = routing.routed_replicas(DEPLOYMENT)
        now = time.monotonic()
        return {r for r in running or () if now - self.last_answer.get(r, now) < self.stall_timeout_s}

    def transfers(self) -> dict:
        """The KV fetches of the D replicas answering: in flight, the oldest's age (s), past their
        deadline, and failures by cause since each started."""
        answers = [self.fetches[r] for r in self.answering() if r in self.fetches]
        failed: Counter[str] = Counter()
        for answer in answers:
            failed.update(answer["failed"])
        return {"in_flight": sum(a["in_flight"] for a in answers),
                "oldest_s": max((a["oldest_s"] for a in answers), default=0.0),
                "past_deadline": sum(a["past_deadline"] for a in answers), "failed": dict(failed)}

    def down(self) -> bool:
        """No D replica can answer: Serve runs none, or none has answered for ``stall_timeout_s``.
        False until this process's router has learnt D's replicas (a probe teaches it)."""
        self._start()
        return routing.routed_replicas(DEPLOYMENT) is not None and not self.answering()

    async def until_down(self) -> None:
        """Returns once ``down()``; checked every ``heartbeat_s``."""
        while not self.down():
            await asyncio.sleep(self.heartbeat_s)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._probing.clear()  # tasks of another (closed) loop, and what they learnt: each replica
            self.last_answer.clear()  # has stall_timeout_s again to answer this loop's probes
            self.fetches.clear()
            self._task = loop.create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            running = routing.routed_replicas(DEPLOYMENT)
            if running is None:  # the router has not learnt D's replicas yet: any replica's answer teaches it
                await self._probe(None)
                continue
            now = time.monotonic()
            for replica in running:
                self.last_answer.setdefault(replica, now)  # new: it has stall_timeout_s to answer
                if replica not in self._probing:
                    self._probing[replica] = asyncio.create_task(self._probe(replica))
            for gone in set(self.last_answer) - running:
                self.last_answer.pop(gone)
                self.fetches.pop(gone, None)
            await asyncio.sleep(self.heartbeat_s)

    async def _probe(self, replica: str | None) -> None:
        """One call to ``replica``'s ``answering`` (any replica's when None); records the answer
    (DecodeAnswer; None from a replica whose engine is not responsive).
        An error (it died) or no answer leaves its last answer to age."""
        call = self.decode.answering.remote(pinned=replica)
        answered = None
        try:
            answered = await asyncio.wait_for(call, max(10 * self.stall_timeout_s, 60.0))
        except TimeoutError:  # silent this long: its age says so already
            call.cancel()
        except Exception:  # it died or cannot be reached: down now, not after stall_timeout_s
            if replica in self.last_answer:
                self.last_answer[replica] = float("-inf")
        finally:
            if replica is not None:
                self._probing.pop(replica, None)
        if answered is not None:  # the replica asked, or (not pinnable: gone) another that answered
            self.last_answer[answered.replica] = time.monotonic()
            self.fetches[answered.replica] = answered.transfers
        elif replica is None:
            await asyncio.sleep(self.heartbeat_s)
