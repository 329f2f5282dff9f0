"""Readiness that tells the truth: a canary request through the engines, and each deployment's state.

``/health`` is 503 at once when a deployment has no live replica: each call reads the replicas'
actors from Ray's registry of named actors (a replica killed leaves it within about a second;
Serve's own status waits for its next health check, up to 10 s), at most every ``LIVE_CACHE_S``.
Otherwise it is 200 only when a canary succeeded within the last ``FRESH_S`` seconds: a short
prompt prefilled on P, its KV fetched and imported by D, a token decoded there (colocated: one
prompt through the engine). Without one it runs one canary (one at a time; concurrent health
checks share its result), bounded by ``CANARY_TIMEOUT_S``, and on failure answers 503 naming
each deployment that is missing, pending or failing, and why, from Ray Serve's own status
(which names the resources a replica that cannot be placed asked for). However often ``/health``
is polled, canaries run at most once per ``FRESH_S`` while they succeed.

In PD, while no D replica can answer (dead in the registry, or silent to the ingress's probes for
``stall_timeout_s``: deployments/pd/decode_watch.py), the app serves on P alone (``pd_degrade_to_prefill``):
``/health`` is then 200 with ``"status": "degraded"`` and the reason, its canary through P alone; with
degradation off, 503 naming D. Likewise while no P replica answers and a D does, the app serves on D
alone (``pd_degrade_to_decode``): "degraded", its canary through D alone; off, 503 naming P. A D
replica whose KV fetch runs past its deadline (a stuck transfer path, as the probes report it) is a
503 naming D too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import logging
import time
from typing import Awaitable, Callable
import uuid

import ray
from ray import serve

from deployments.pd import routing
from deployments.pd.backends import PDBackend
from deployments.pd.decode_watch import NO_ANSWER, NO_PREFILL_ANSWER
from deployments.pd.compatibility import INCOMPATIBLE
from deployments.failures import REPLICA_FAILURES, root_cause
from engine.request import PRIORITY_MIN, GenerationRequest
from sampling.params import SamplingParams

logger = logging.getLogger("ray.serve." + __name__)  # Serve's handlers add the request id to each line

FRESH_S = 10.0  # a canary younger than this answers /health without a new one
CANARY_TIMEOUT_S = 5.0
STATUS_TIMEOUT_S = 2.0
LIVE_CACHE_S = 0.5  # /health reads the live replicas at most this often: one registry call, whatever the polling
CANARY_PROMPT_TOKENS = 32  # two KV blocks at the default block size: D must hold a short prompt
# Ray Serve's deployment states, as /health names them.
STATES = {"HEALTHY": "healthy", "UPSCALING": "healthy", "DOWNSCALING": "healthy", "UPDATING": "pending",
          "UNHEALTHY": "failing", "DEPLOY_FAILED": "failing"}


@dataclass
class CanaryResult:
    ok: bool
    at: float  # time.monotonic() when it ended
    deployment: str | None = None  # where it failed
    reason: str | None = None
    alone: str | None = None  # the one deployment it went through (PD degraded: the other did not answer)


def canary_request(timeout_s: float) -> GenerationRequest:
    """Two greedy tokens: the first sampled on P, the second decoded on D. Token ids 1..32 are
    in every vocabulary; asking the engines for theirs first would be one more call that can hang."""
    prompt = list(range(1, CANARY_PROMPT_TOKENS + 1))
    return GenerationRequest(f"canary-{uuid.uuid4().hex}", prompt,
                             SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
                             priority=PRIORITY_MIN, deadline=time.time() + timeout_s)


async def app_deployments(timeout_s: float) -> dict:
    """The calling replica's application's deployments in Serve's status, by name; raises if
    Serve's status does not come within ``timeout_s``."""
    app = serve.get_replica_context().app_name
    status = await asyncio.wait_for(asyncio.to_thread(serve.status), timeout_s)
    return status.applications[app].deployments


async def live_replicas(app: str, deployments: list[str], timeout_s: float) -> dict[str, set[str]]:
    """The live replica actors of each of ``app``'s ``deployments``, from Ray's registry of named actors:
    a replica's actor is named by its full id, "SERVE_REPLICA::<app>#<deployment>#<id>", and a killed
    one's name is gone within a fraction of a second (a starting one's is there before it serves)."""
    named = await asyncio.wait_for(asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True), timeout_s)
    live: dict[str, set[str]] = {name: set() for name in deployments}
    for actor in named:
        app_part, _, rest = actor["name"].partition("::")[2].partition("#")
        deployment = rest.split("#", 1)[0]
        if app_part == app and deployment in live:
            live[deployment].add(actor["name"])
    return live


def describe(error: BaseException) -> str:
    """An error's type and, for our own checks (ValueError), its message; never Ray's internals
    (not even their exception names)."""
    cause = root_cause(error)
    if isinstance(cause, (asyncio.TimeoutError, TimeoutError)):
        return "no answer in time"
    if isinstance(cause, REPLICA_FAILURES):
        return "a replica failed or is unreachable"
    return f"{type(cause).__name__}: {cause}" if isinstance(cause, ValueError) else type(cause).__name__


def _named(incompatible: list[str]) -> dict:
    """/health's list of unpaired replicas, each with the fields it differs in; nothing when none is."""
    return {"incompatible": incompatible} if incompatible else {}


class Readiness:
    """The canary and the deployments' states behind ``/health``.

    ``backend`` is the ingress's ColocatedBackend or PDBackend; its ``handles`` name the engine
    deployments in the order a request visits them."""

    def __init__(self, backend, embedder, engines_ready: Callable[[], Awaitable]) -> None:
        """``engines_ready()``: what a request waits for before it reaches an engine (every engine
        deployment's info, ServeEngineClient.model_info); it raises while they are not ready."""
        self.backend, self.embedder, self.engines_ready = backend, embedder, engines_ready
        self.expected = [*backend.handles, *(["EmbeddingServer"] if embedder is not None else [])]
        self.last: CanaryResult | None = None
        self._lock = asyncio.Lock()
        self._live: tuple[float, dict[str, set[str]]] | None = None  # (time.monotonic(), live replica ids)

    async def check(self) -> tuple[bool, dict]:
        """(ready, body). 503 at once for a deployment without a live replica; else runs a canary
        unless a recent one succeeded."""
        dead = await self.without_replicas()
        pd = isinstance(self.backend, PDBackend)
        decode_down = pd and ("DecodeServer" in dead or self.backend.watch.down())
        incompatible = self.backend.watch.incompatible() if pd else []  # each unpaired replica, and why
        why_down = NO_ANSWER if "DecodeServer" in dead or not pd else self.backend.watch.why_down()
        prefill_down = pd and not decode_down and ("PrefillServer" in dead or self.backend.watch.prefill_down())
        failing = {name: "no live replica" for name in dead}
        if decode_down and self.backend.degrade_to_prefill:
            failing.pop("DecodeServer", None)  # P serves alone: degraded, not down
        elif decode_down:
            failing.setdefault("DecodeServer", why_down)
        if prefill_down and self.backend.degrade_to_decode:
            failing.pop("PrefillServer", None)  # D serves alone
        elif prefill_down:
            failing.setdefault("PrefillServer", NO_PREFILL_ANSWER)
        alone = "PrefillServer" if decode_down else "DecodeServer" if prefill_down else None
        if pd and (stuck := self.backend.watch.transfers())["past_deadline"]:
            failing.setdefault("DecodeServer", f"{stuck['past_deadline']} KV transfer(s) past their deadline, "
                                               f"the oldest {stuck['oldest_s']:.0f} s old")
        if failing:
            self.last = None  # a canary from before the loss says nothing of the replicas that replace it
            states = {name: {"status": "healthy"} for name in self.expected}
            states.update({name: {"status": "failing", "reason": reason} for name, reason in failing.items()})
            return False, {"status": "unavailable", "deployments": states, **_named(incompatible)}
        try:  # not ready for requests (an engine deployment never placed, say): not ready for /health
            await self.engines_ready()
        except Exception:
            return False, {"status": "unavailable", "deployments": await self.deployment_states(),
                           **_named(incompatible)}
        async with self._lock:  # one canary at a time; a waiter reads the result it left
            if not (self.last and self.last.ok and time.monotonic() - self.last.at < FRESH_S
                    and self.last.alone == alone):
                self.last = await self.canary(alone)
        if self.last.ok:
            age = round(time.monotonic() - self.last.at, 3)
            if decode_down:
                return True, {"status": "degraded", "reason": f"{why_down}: prefill replicas decode",
                              "canary_age_s": age, **_named(incompatible)}
            if prefill_down:
                return True, {"status": "degraded", "reason": f"{NO_PREFILL_ANSWER}: decode replicas prefill",
                              "canary_age_s": age, **_named(incompatible)}
            if incompatible:  # pairs serve; the unpaired replicas take no request
                return True, {"status": "degraded", "reason": f"{INCOMPATIBLE}: unpaired replicas take no request",
                              "canary_age_s": age, **_named(incompatible)}
            return True, {"status": "ok", "canary_age_s": age}
        deployments = await self.deployment_states()
        if self.last.deployment and deployments.get(self.last.deployment, {}).get("status") == "healthy":
            deployments[self.last.deployment] = {"status": "failing", "reason": self.last.reason}
        return False, {"status": "unavailable", "canary": {"deployment": self.last.deployment,
                                                           "reason": self.last.reason},
                       "deployments": deployments, **_named(incompatible)}

    async def without_replicas(self) -> list[str]:
        """The deployments with no replica both running (Serve's word to this process's router, which
        learns of a death only at the controller's next health check) and alive (Ray's registry, which
        learns of it at once). Read at most every ``LIVE_CACHE_S``; none when the registry does not
        answer (the canary then says what works)."""
        now = time.monotonic()
        if self._live is None or now - self._live[0] >= LIVE_CACHE_S:
            try:
                app = serve.get_replica_context().app_name
                self._live = (now, await live_replicas(app, self.expected, STATUS_TIMEOUT_S))
            except Exception as error:
                logger.warning("health: the replicas' registry did not answer: %s", describe(error))
                return []
        dead = []
        for name, alive in self._live[1].items():
            running = routing.routed_replicas(name)  # None before this process routed to it: alive decides
            if not (alive & running if running is not None else alive):
                dead.append(name)
        return dead

    async def canary(self, alone: str | None = None) -> CanaryResult:
        """One short request through every engine deployment (through ``alone``, P or D, when the
        other does not answer), and the embedder's info call."""
        names = [alone] if alone else list(self.backend.handles)
        reached = 0  # outputs seen: P answered once the first token is back
        try:
            async with asyncio.timeout(CANARY_TIMEOUT_S):
                outputs = []
                request = canary_request(CANARY_TIMEOUT_S)
                # In PD, through P and D whatever the policy says: both are checked.
                pd = isinstance(self.backend, PDBackend)
                stream = (self.backend.prefill_only(request, counted=False) if alone == "PrefillServer" else
                          self.backend.decode_only(request, counted=False) if alone == "DecodeServer" else
                          self.backend.stream(request, disaggregate=True) if pd else self.backend.stream(request))
                async for batch in stream:
                    for output in batch:
                        reached += 1
                        if output.error:
                            raise RuntimeError(output.error)
                        outputs.append(output)
                tokens = sum(len(o.new_token_ids) for o in outputs)
                if tokens != 2:
                    raise RuntimeError(f"the canary made {tokens} tokens, not 2")
        except Exception as error:
            where = names[min(reached, len(names) - 1)]
            logger.warning("health canary failed at %s: %s", where, describe(error))
            return CanaryResult(False, time.monotonic(), where, describe(error), alone)
        if self.embedder is not None:
            try:
                await asyncio.wait_for(self.embedder.info.remote(), CANARY_TIMEOUT_S)
            except Exception as error:
                return CanaryResult(False, time.monotonic(), "EmbeddingServer", describe(error), alone)
        return CanaryResult(True, time.monotonic(), alone=alone)

    async def deployment_states(self) -> dict[str, dict]:
        """Each deployment of this application but the ingress: its state and, if not healthy, why."""
        try:
            deployments = await app_deployments(STATUS_TIMEOUT_S)
        except Exception as error:
            return {name: {"status": "unknown", "reason": f"Serve's status: {describe(error)}"}
                    for name in self.expected}
        states = {name: {"status": "missing", "reason": "not deployed"} for name in self.expected}
        for name, info in deployments.items():
            if name == "Ingress":
                continue
            state = STATES.get(str(info.status).rsplit(".", 1)[-1], "unknown")
            states[name] = {"status": state} if state == "healthy" else {"status": state,
                                                                         "reason": info.message or "starting"}
        return states

    async def watch_start(self, interval_s: float = 10.0, limit_s: float = 3600.0) -> None:
        """At start-up, log each deployment that is not yet running, and why, until all are."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            waiting = {n: s for n, s in (await self.deployment_states()).items() if s["status"] != "healthy"}
            if not waiting:
                logger.info("every deployment is running: %s", ", ".join(self.expected))
                return
            for name, state in waiting.items():
                logger.warning("%s is %s: %s", name, state["status"], state["reason"])
            await asyncio.sleep(interval_s)
