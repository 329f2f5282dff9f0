"""Which P and D replicas answer, and which may be paired: PD's degradation to P-only decoding
(docs/serving.md, "No decode replica") and its compatibility check ("Compatible pairs").

A replica that is dead, SIGSTOPped or stuck in one engine step takes calls it never serves, and a
stream watch (deployments/replicas/liveness.py) only sees it through a request that waits on it. So the
ingress asks every replica of a role itself (``RoleWatch``), every ``heartbeat_s``: ``answering``,
pinned to that replica, which answers with its id, its KV fetches and what its KV means
(deployments/pd/compatibility.py) while its engine thread runs and no step has run past the step
watchdog. A replica has at most ``PROBES_IN_FLIGHT`` probes unanswered (a stopped replica collects no
pile of them). It is *answering* until it has been silent for ``stall_timeout_s`` with at least
``MISSED_PROBES`` probes missed (a probe is missed once it has gone a heartbeat unanswered, or failed):
under a burst one slow probe answer does not call a live replica down (issue 55); a probe that fails
as a replica failure (it died) does, at once. One new to the ingress has ``stall_timeout_s`` to answer.

``DecodeWatch`` watches D, and P beside it for its descriptors and its answers: it pairs them (compatibility.pair),
tells the routers which replicas are paired (deployments/pd/routing.py routes to those alone: an
unpaired replica, or one not described yet, takes no request), logs each
mismatch once, and counts an unpaired D as not answering. When no D answers, D is *down*: the PD
backend (deployments/pd/backends.py) then runs new requests on P as a colocated engine, moves the
ones waiting for a D there, and goes back to P then D as soon as one replica answers again. When
no P answers (``prefill_down``) while D does, D serves new requests whole, prefilling them itself.

Each D answer also carries the replica's KV fetches (in flight, the oldest's age, past their
deadline, failed by cause: KVConnector.transfer_health): ``transfers`` sums them over the D replicas
that answer, for /metrics and /health.

Probes go through the deployment's own handle and request router (the ``pinned`` keyword,
deployments/pd/routing.py): the replicas probed are the ones Serve tells this process's router of.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import logging
import time

from ray.serve.handle import DeploymentHandle

from deployments.failures import replica_failed
from deployments.pd import routing
from deployments.pd.compatibility import INCOMPATIBLE, KVDescriptor, Pairing, pair

DEPLOYMENT = "DecodeServer"
PREFILL = "PrefillServer"
PROBES_IN_FLIGHT = 2  # unanswered probes a replica may have at once
MISSED_PROBES = 2  # a silent replica is called down only once this many of its probes were missed
NO_ANSWER = "no decode replica answers"
NO_PREFILL_ANSWER = "no prefill replica answers"
NO_PAIR = f"{INCOMPATIBLE}: no decode replica is paired with a prefill replica"

logger = logging.getLogger("ray.serve." + __name__)


class RoleWatch:
    """The ingress's view of which replicas of one role (``deployment``) answer. Starts its probing
    on the first ``answering()`` call of an event loop (the ingress's, or a test's)."""

    def __init__(self, handle: DeploymentHandle, deployment: str, heartbeat_s: float, stall_timeout_s: float) -> None:
        self.handle, self.deployment = handle, deployment
        self.heartbeat_s, self.stall_timeout_s = heartbeat_s, stall_timeout_s
        self.last_answer: dict[str, float] = {}  # replica id -> time.monotonic() of its last answer, or first sight
        self.failed: Counter[str] = Counter()  # replica id -> probes failed since its last answer
        self.fetches: dict[str, dict] = {}  # replica id -> its KV fetches, as it last answered
        self.descriptors: dict[str, KVDescriptor] = {}  # replica id -> what its KV means, as it stated
        self.on_descriptors = lambda: None  # called when a replica states a new descriptor or one leaves
        self._probing: dict[str, dict[asyncio.Task, float]] = {}  # replica id -> its unanswered probes' send times
        self._task: asyncio.Task | None = None

    def answering(self) -> set[str]:
        """The replicas Serve runs that have not been silent for ``stall_timeout_s`` with
        ``MISSED_PROBES`` probes missed."""
        self._start()
        now = time.monotonic()
        return {r for r in routing.routed_replicas(self.deployment) or () if not self._silent(r, now)}

    def _silent(self, replica: str, now: float) -> bool:
        if now - self.last_answer.get(replica, now) < self.stall_timeout_s:
            return False
        late = sum(now - sent >= self.heartbeat_s for sent in self._probing.get(replica, {}).values())
        return self.failed[replica] + late >= MISSED_PROBES

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._probing.clear()  # tasks of another (closed) loop, and what they learnt: each replica
            self.last_answer.clear()  # has stall_timeout_s again to answer this loop's probes
            self.failed.clear()
            self.fetches.clear()
            self._task = loop.create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            running = routing.routed_replicas(self.deployment)
            if running is None:  # the router has not learnt the replicas yet: any replica's answer teaches it
                await self._probe(None)
                continue
            now = time.monotonic()
            for replica in running:
                self.last_answer.setdefault(replica, now)  # new: it has stall_timeout_s to answer
                probes = self._probing.setdefault(replica, {})
                if len(probes) < PROBES_IN_FLIGHT:
                    probes[asyncio.create_task(self._probe(replica))] = now
            gone = set(self.last_answer) - running
            for replica in gone:
                for table in (self.last_answer, self.failed, self.fetches, self._probing):
                    table.pop(replica, None)
            if gone & set(self.descriptors):
                for replica in gone:
                    self.descriptors.pop(replica, None)
                self.on_descriptors()
            await asyncio.sleep(self.heartbeat_s)

    async def _probe(self, replica: str | None) -> None:
        """One call to ``replica``'s ``answering`` (any replica's when None); records the answer
        (ProbeAnswer; None from a replica whose engine is not responsive). A replica failure (it
        died, or cannot be reached) calls it down at once; no answer or another error is a missed probe."""
        call = self.handle.answering.remote(pinned=replica)
        answered = None
        try:
            answered = await asyncio.wait_for(call, max(10 * self.stall_timeout_s, 60.0))
        except TimeoutError:  # silent this long: its age says so already
            call.cancel()
        except Exception as error:
            if replica in self.last_answer:
                self.failed[replica] += MISSED_PROBES if replica_failed(error) else 1
                if replica_failed(error):
                    self.last_answer[replica] = float("-inf")
        finally:
            if replica is not None:
                self._probing.get(replica, {}).pop(asyncio.current_task(), None)
        if answered is not None:  # the replica asked, or (not pinnable: gone) another that answered
            self.last_answer[answered.replica] = time.monotonic()
            self.failed.pop(answered.replica, None)
            self.fetches[answered.replica] = answered.transfers
            if self.descriptors.get(answered.replica) != answered.kv:
                self.descriptors[answered.replica] = answered.kv
                self.on_descriptors()
        elif replica is None:
            await asyncio.sleep(self.heartbeat_s)


class DecodeWatch(RoleWatch):
    """D's watch, paired with P's (``prefill``: P's handle; None: no pairing, as in the tests of D
    alone). Starts both on the first ``down()`` call of an event loop."""

    def __init__(self, decode: DeploymentHandle, heartbeat_s: float, stall_timeout_s: float,
                 prefill: DeploymentHandle | None = None) -> None:
        super().__init__(decode, DEPLOYMENT, heartbeat_s, stall_timeout_s)
        self.prefill = RoleWatch(prefill, PREFILL, heartbeat_s, stall_timeout_s) if prefill is not None else None
        self.pairing = Pairing(None, {})
        self._named: set[str] = set()  # the mismatches logged already
        self.on_descriptors = self._pair
        if self.prefill is not None:
            self.prefill.on_descriptors = self._pair

    def answering(self) -> set[str]:
        """The D replicas Serve runs that answer (RoleWatch) and are paired with P."""
        if self.prefill is not None:
            self.prefill.answering()  # starts P's probes
        return super().answering() - set(self.pairing.unpaired.get(DEPLOYMENT, {}))

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
        """No D replica can be used: Serve runs none, none has answered (RoleWatch), or none is
        paired with P. False until this process's router has learnt D's replicas (a probe teaches it)."""
        answering = self.answering()
        return routing.routed_replicas(DEPLOYMENT) is not None and not answering

    def prefill_answering(self) -> set[str]:
        """The P replicas Serve runs that answer (RoleWatch) and are paired with D; none without a P watch."""
        if self.prefill is None:
            return set()
        return self.prefill.answering() - set(self.pairing.unpaired.get(PREFILL, {}))

    def prefill_down(self) -> bool:
        """No P replica can be used: Serve runs none, or none has answered. False without a P watch,
        and until this process's router has learnt P's replicas."""
        return (self.prefill is not None and routing.routed_replicas(PREFILL) is not None
                and not self.prefill_answering())

    def why_down(self) -> str:
        """What ``down()`` means now: no D is paired with P (some D answers, none may take P's KV), or
        none answers."""
        unpaired = set(self.pairing.unpaired.get(DEPLOYMENT, {}))
        return NO_PAIR if unpaired and unpaired & super().answering() else NO_ANSWER

    def incompatible(self) -> list[str]:
        """Each unpaired replica and the fields it differs in (compatibility.Pairing.reasons)."""
        return self.pairing.reasons()

    async def until_down(self) -> None:
        """Returns once ``down()``; checked every ``heartbeat_s``."""
        while not self.down():
            await asyncio.sleep(self.heartbeat_s)

    def _pair(self) -> None:
        """Pairs the replicas' descriptors again: the routers take the paired alone, the log names
        each mismatch the first time it is seen."""
        prefill = self.prefill.descriptors if self.prefill is not None else {}
        self.pairing = pair(prefill, self.descriptors)
        chosen = self.pairing.descriptor
        if chosen is not None:  # a replica not described yet (new) takes no call until it is
            routing.set_paired(PREFILL, {r for r, d in prefill.items() if d == chosen})
            routing.set_paired(DEPLOYMENT, {r for r, d in self.descriptors.items() if d == chosen})
        else:  # nothing to pair yet (any replica may serve), or no D may take P's KV (P serves alone)
            routing.set_paired(PREFILL, None)
            routing.set_paired(DEPLOYMENT, set() if DEPLOYMENT in self.pairing.unpaired else None)
        for reason in self.pairing.reasons():
            if reason not in self._named:
                self._named.add(reason)
                logger.warning("not paired: %s", reason)
