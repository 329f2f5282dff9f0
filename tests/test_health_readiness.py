"""The ingress's readiness (deployments/ingress/health.py) in one process, without Ray: what /health
answers (ok, degraded, unavailable, and each deployment's state and why) from the replicas' registry,
the role watches, the canary and Serve's status, each given by a fake. The served checks (a replica
killed, an app never placed, D stopped) are tests/test_operations.py's and tests/test_faults.py's."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from deployments.ingress import health
from deployments.ingress.health import Readiness
from deployments.pd import routing
from deployments.pd.backends import PDBackend
from deployments.pd.compatibility import INCOMPATIBLE
from deployments.pd.decode_watch import NO_ANSWER, NO_PREFILL_ANSWER
from engine.outputs import RequestOutput
from engine.request import PRIORITY_MIN

PD = ["PrefillServer", "DecodeServer"]


def output(tokens: int, error: str | None = None) -> RequestOutput:
    return RequestOutput("canary", list(range(tokens)), "", tokens, True, "length", 1, error=error)


class Stream:
    """The backend's streams, each yielding ``batches``; records which way each canary went."""

    def __init__(self, batches):
        self.batches, self.calls = batches, []

    def way(self, name):
        async def stream(request, *args, **kwargs):
            self.calls.append((name, request, kwargs))
            for batch in self.batches:
                if isinstance(batch, Exception):  # the call fails before this batch
                    raise batch
                yield batch
        return stream


class Watch:
    def __init__(self, down=False, prefill_down=False, why=NO_ANSWER, incompatible=(), past_deadline=0):
        self._down, self._prefill_down, self._why, self._incompatible = down, prefill_down, why, list(incompatible)
        self._transfers = {"past_deadline": past_deadline, "oldest_s": 42.4}

    def down(self):
        return self._down

    def prefill_down(self):
        return self._prefill_down

    def why_down(self):
        return self._why

    def incompatible(self):
        return self._incompatible

    def transfers(self):
        return self._transfers


def pd_backend(watch: Watch, streams: Stream, degrade_to_prefill=True, degrade_to_decode=True) -> PDBackend:
    backend = PDBackend.__new__(PDBackend)  # its parts a request needs, not its handles' Ray
    backend.watch, backend.handles = watch, dict.fromkeys(PD)
    backend.degrade_to_prefill, backend.degrade_to_decode = degrade_to_prefill, degrade_to_decode
    backend.stream, backend.prefill_only, backend.decode_only = (streams.way(w) for w in ("pd", "prefill", "decode"))
    return backend


def colocated(streams: Stream):
    return SimpleNamespace(handles={"LLMServer": None}, stream=streams.way("colocated"))


@pytest.fixture
def registry(monkeypatch):
    """The live replicas by deployment (all live unless a test says otherwise) and Serve's status."""
    live = {}
    status = {}

    async def live_replicas(app, deployments, timeout_s):
        return {name: live.get(name, {f"{name}#1"}) for name in deployments}

    async def app_deployments(timeout_s):
        if isinstance(status, Exception):
            raise status
        return {name: SimpleNamespace(status=f"DeploymentStatus.{state}", message=message)
                for name, (state, message) in status.items()}

    monkeypatch.setattr(health.serve, "get_replica_context", lambda: SimpleNamespace(app_name="app"))
    monkeypatch.setattr(health, "live_replicas", live_replicas)
    monkeypatch.setattr(health, "app_deployments", app_deployments)
    monkeypatch.setattr(routing, "_routed", {})
    return SimpleNamespace(live=live, status=status)


async def ready():
    return None


def check(readiness: Readiness) -> tuple[bool, dict]:
    ok, body = asyncio.run(readiness.check())
    body.pop("canary_age_s", None)
    return ok, body


def test_colocated_is_ok_after_one_canary_of_two_tokens_then_answers_from_it(registry):
    streams = Stream([[output(1)], [output(1)]])
    readiness = Readiness(colocated(streams), None, ready)
    assert check(readiness) == (True, {"status": "ok"})
    assert check(readiness) == (True, {"status": "ok"})
    assert [(way, kwargs) for way, _, kwargs in streams.calls] == [("colocated", {})]  # the second: from the first
    request = streams.calls[0][1]
    assert 0 < request.deadline - time.time() <= health.CANARY_TIMEOUT_S
    assert request.prompt_token_ids == list(range(1, 33)) and request.priority == PRIORITY_MIN
    assert request.params.max_new_tokens == 2 and request.params.temperature == 0.0 and request.params.ignore_eos
    readiness.last.at -= health.FRESH_S  # an old canary: a new one
    assert check(readiness) == (True, {"status": "ok"}) and len(streams.calls) == 2


@pytest.mark.parametrize("batches,reason", [([[output(1)]], "RuntimeError"),
                                            ([[output(1, error="engine failed")]], "RuntimeError")])
def test_a_failed_canary_is_unavailable_naming_the_deployment_and_why(registry, batches, reason):
    registry.status.update(LLMServer=("HEALTHY", ""), Ingress=("UNHEALTHY", "ignored"))
    readiness = Readiness(colocated(Stream(batches)), None, ready)
    assert check(readiness) == (False, {
        "status": "unavailable", "canary": {"deployment": "LLMServer", "reason": reason},
        "deployments": {"LLMServer": {"status": "failing", "reason": reason}}})


def test_a_deployment_without_a_live_replica_is_unavailable_at_once_without_a_canary(registry):
    streams = Stream([[output(2)]])
    registry.live["DecodeServer"] = set()
    readiness = Readiness(pd_backend(Watch(), streams, degrade_to_prefill=False), None, ready)
    assert check(readiness) == (False, {"status": "unavailable", "deployments": {
        "PrefillServer": {"status": "healthy"}, "DecodeServer": {"status": "failing", "reason": "no live replica"}}})
    assert streams.calls == []


def test_a_replica_alive_in_the_registry_but_no_longer_routed_to_is_not_live(registry, monkeypatch):
    monkeypatch.setattr(routing, "_routed", {"PrefillServer": {"other"}, "DecodeServer": {"DecodeServer#1"}})
    readiness = Readiness(pd_backend(Watch(), Stream([[output(2)]])), None, ready)
    assert asyncio.run(readiness.without_replicas()) == ["PrefillServer"]
    registry.live["PrefillServer"] = {"other"}  # read again only after LIVE_CACHE_S
    assert asyncio.run(readiness.without_replicas()) == ["PrefillServer"]
    readiness._live = (readiness._live[0] - health.LIVE_CACHE_S, readiness._live[1])
    assert asyncio.run(readiness.without_replicas()) == []


def test_pd_canary_goes_through_p_and_d(registry):
    streams = Stream([[output(1)], [output(1)]])
    assert check(Readiness(pd_backend(Watch(), streams), None, ready)) == (True, {"status": "ok"})
    assert [(way, kwargs) for way, _, kwargs in streams.calls] == [("pd", {"disaggregate": True})]


@pytest.mark.parametrize("batches,where", [([RuntimeError("P refused")], "PrefillServer"),
                                           ([[output(1)], [output(0, error="D failed")]], "DecodeServer"),
                                           ([[output(1)], [output(1)], [output(1)]], "DecodeServer")])
def test_a_pd_canary_names_where_it_failed_p_before_its_first_token_d_after(registry, batches, where):
    registry.status.update(PrefillServer=("HEALTHY", ""), DecodeServer=("HEALTHY", ""))
    ok, body = check(Readiness(pd_backend(Watch(), Stream(batches)), None, ready))
    assert not ok and body["canary"]["deployment"] == where and body["deployments"][where]["status"] == "failing"


def test_d_down_is_degraded_with_its_canary_through_p_alone_or_unavailable_when_degradation_is_off(registry):
    streams = Stream([[output(2)]])
    assert check(Readiness(pd_backend(Watch(down=True, why="no decode"), streams), None, ready)) == (
        True, {"status": "degraded", "reason": "no decode: prefill replicas decode"})
    assert [(way, kwargs) for way, _, kwargs in streams.calls] == [("prefill", {"counted": False})]
    off = Readiness(pd_backend(Watch(down=True, why="no decode"), streams, degrade_to_prefill=False), None, ready)
    assert check(off) == (False, {"status": "unavailable", "deployments": {
        "PrefillServer": {"status": "healthy"}, "DecodeServer": {"status": "failing", "reason": "no decode"}}})
    registry.live["DecodeServer"] = set()  # dead in the registry: its reason is NO_ANSWER, whatever the watch says
    assert check(Readiness(pd_backend(Watch(why="other"), streams), None, ready)) == (
        True, {"status": "degraded", "reason": f"{NO_ANSWER}: prefill replicas decode"})


def test_p_down_is_degraded_with_its_canary_through_d_alone_or_unavailable_when_degradation_is_off(registry):
    streams = Stream([[output(2)]])
    assert check(Readiness(pd_backend(Watch(prefill_down=True), streams), None, ready)) == (
        True, {"status": "degraded", "reason": f"{NO_PREFILL_ANSWER}: decode replicas prefill"})
    assert [(way, kwargs) for way, _, kwargs in streams.calls] == [("decode", {"counted": False})]
    off = Readiness(pd_backend(Watch(prefill_down=True), streams, degrade_to_decode=False), None, ready)
    assert check(off) == (False, {"status": "unavailable", "deployments": {
        "PrefillServer": {"status": "failing", "reason": NO_PREFILL_ANSWER}, "DecodeServer": {"status": "healthy"}}})
    registry.live["PrefillServer"] = set()
    assert check(Readiness(pd_backend(Watch(), streams, degrade_to_decode=False), None, ready))[1][
        "deployments"]["PrefillServer"] == {"status": "failing", "reason": "no live replica"}


def test_unpaired_replicas_are_named_and_degraded_and_transfers_past_their_deadline_are_unavailable(registry):
    streams = Stream([[output(2)]])
    unpaired = ["DecodeServer#2: block_size 32, not 16"]
    assert check(Readiness(pd_backend(Watch(incompatible=unpaired), streams), None, ready)) == (True, {
        "status": "degraded", "reason": f"{INCOMPATIBLE}: unpaired replicas take no request", "incompatible": unpaired})
    stuck = Readiness(pd_backend(Watch(past_deadline=2), streams), None, ready)
    assert check(stuck) == (False, {"status": "unavailable", "deployments": {
        "PrefillServer": {"status": "healthy"},
        "DecodeServer": {"status": "failing", "reason": "2 KV transfer(s) past their deadline, the oldest 42 s old"}}})


def test_engines_not_ready_are_unavailable_with_serves_states_of_each_deployment(registry):
    async def not_ready():
        raise RuntimeError("no info yet")

    registry.status.update(PrefillServer=("HEALTHY", ""), DecodeServer=("DEPLOY_FAILED", "no GPU to place it"),
                           EmbeddingServer=("UPDATING", ""))
    readiness = Readiness(pd_backend(Watch(), Stream([])), SimpleNamespace(), not_ready)
    assert check(readiness) == (False, {"status": "unavailable", "deployments": {
        "PrefillServer": {"status": "healthy"},
        "DecodeServer": {"status": "failing", "reason": "no GPU to place it"},
        "EmbeddingServer": {"status": "pending", "reason": "starting"}}})
    registry.status.clear()
    assert asyncio.run(readiness.deployment_states())["DecodeServer"] == {"status": "missing", "reason": "not deployed"}


def test_serves_status_not_answering_is_unknown_and_errors_are_described_without_rays_internals(monkeypatch, registry):
    async def slow(timeout_s):
        raise TimeoutError

    monkeypatch.setattr(health, "app_deployments", slow)
    readiness = Readiness(colocated(Stream([])), None, ready)
    assert asyncio.run(readiness.deployment_states()) == {
        "LLMServer": {"status": "unknown", "reason": "Serve's status: no answer in time"}}
    assert health.describe(ValueError("bad")) == "ValueError: bad"
    assert health.describe(KeyError("secret")) == "KeyError"


def test_a_canary_that_passes_the_engines_but_not_the_embedder_names_the_embedder(registry):
    async def info():
        raise ValueError("no model")

    embedder = SimpleNamespace(info=SimpleNamespace(remote=info))
    readiness = Readiness(colocated(Stream([[output(2)]])), embedder, ready)
    ok, body = check(readiness)
    assert not ok and body["canary"] == {"deployment": "EmbeddingServer", "reason": "ValueError: no model"}


def test_live_replicas_reads_each_deployments_actors_of_this_app_from_the_registry(monkeypatch):
    names = ["SERVE_REPLICA::app#DecodeServer#a", "SERVE_REPLICA::app#DecodeServer#b",
             "SERVE_REPLICA::other#PrefillServer#c", "SERVE_REPLICA::app#Ingress#d", "SERVE_CONTROLLER_ACTOR"]
    monkeypatch.setattr(health.ray.util, "list_named_actors", lambda all_namespaces: [{"name": n} for n in names])
    assert asyncio.run(health.live_replicas("app", PD, 1.0)) == {
        "PrefillServer": set(), "DecodeServer": {"SERVE_REPLICA::app#DecodeServer#a", "SERVE_REPLICA::app#DecodeServer#b"}}
