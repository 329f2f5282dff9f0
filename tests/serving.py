"""Starting Ray Serve for real on loopback, and reading its responses."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import time

import httpx
import psutil


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The names by which a test module starts Ray + Serve: tests/workers.py runs every module that uses
# one in the one worker that runs the served modules.
STARTS_SERVE = ("serve_session", "shared_url", "kept_app", "kept_apps", "openai_apps", "agents_app", "ray.init")
PROXY_START_ATTEMPTS = 3  # a free port can be taken before the proxy binds it: pick another
SUITE_CPUS = 16  # logical CPUs of the suite's shared Ray: room for the largest module's apps beside the kept ones

# The suite's one Ray + Serve, shared by every module that needs no Ray of its own: starting Ray and
# Serve costs ~15 s a module on two cores. Started by the first module that asks, stopped at the end
# of the session (tests/conftest.py) or when a module starts a Ray of its own (two Rays on one machine
# collide). "kept" are the applications deployed once for several modules (``kept_app``), "deleting"
# the ones a module deleted on its way out that Serve may still list (``app_names``).
_shared: dict = {"url": None, "kept": set(), "deleting": set()}


@contextlib.contextmanager
def serve_session(num_cpus: int | None = None, address: str | None = None):
    """Ray and Serve's HTTP proxy on a free loopback port; yields the base URL.

    With no arguments: the suite's shared Ray + Serve; the applications deployed inside the block
    (but kept ones) are deleted on the way out, so the next module finds only the kept ones. With
    ``num_cpus`` or ``address`` (a fresh local instance of that size, or that cluster): a Ray of its
    own, shut down afterwards, also when the start fails."""
    from ray import serve

    if num_cpus is None and address is None:
        url = shared_url()
        before = app_names()  # not those still being deleted: this module may deploy one of their names again
        try:
            yield url
        finally:
            # Deleted, not waited for: the next module goes on while these replicas stop (5 to 7 s of
            # waiting a module); a deploy of the same name waits for the deletion first (``deploy``).
            for name in app_names() - before - _shared["kept"]:
                serve.delete(name, _blocking=False)
                _shared["deleting"].add(name)
        return
    stop_shared_session()
    try:
        yield _start_ray_and_serve(num_cpus or 8, address)
    finally:
        _stop_ray_and_serve(ours=address is None)


def deploy(apps: dict, route_prefixes: dict[str, str] | None = None, together: bool = True) -> None:
    """Deploy every application of ``apps`` (name -> Application, at "/<name>" unless
    ``route_prefixes`` names another), and wait until all run (``wait_running``). ``together``: in one
    call, their replicas starting together, so no app waits for the one before it to finish starting;
    else one app after the other, for apps whose replicas load a real model (several loading at once
    take the 2-core box's 24 GB past Ray's memory threshold, and its monitor kills workers)."""
    from ray import serve

    def deleting() -> set[str]:  # an app of the same name deleted by a module before (``serve_session``)
        return app_names(deleting=True) & set(apps)

    assert wait_until(lambda: not deleting(), DELETE_S, 0.5), f"still being deleted after {DELETE_S} s: {deleting()}"
    prefixes = route_prefixes or {}
    targets = [serve.RunTarget(target=app, name=name, route_prefix=prefixes.get(name, f"/{name}"))
               for name, app in apps.items()]
    for batch in [targets] if together else [[target] for target in targets]:
        serve.run_many(batch, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        wait_running([target.name for target in batch])


def versioned(app, version: str = "faults"):
    """``app`` (a Serve Application) with every deployment at code version ``version``, as Serve
    gives a config file's app: then a redeploy that changes only replica counts updates the app in
    place (a scale-down). ``serve.run`` gives a Python app's deployments a random version each time
    (client.py: ``deployment._version or get_random_string()``), and ``Deployment.options`` no
    longer takes one, so it is set where that line reads it."""
    from ray.serve import Application

    deployment = app._bound_deployment
    deployment._version = version
    for value in [*deployment.init_args, *deployment.init_kwargs.values()]:
        if isinstance(value, Application):
            versioned(value, version)
    return app


def app_names(deleting: bool = False) -> set[str]:
    """The applications Serve has: those being deleted (``deleting``), or all the others. Being
    deleted: Serve says so, or ``serve_session`` asked for it and Serve's status still says what it
    said before (it catches up at its controller's next loop)."""
    from ray import serve

    statuses = serve.status().applications
    _shared["deleting"] &= set(statuses)  # the ones gone from Serve's list are deleted
    being_deleted = {name for name, app in statuses.items() if app.status == "DELETING"} | _shared["deleting"]
    return being_deleted if deleting else set(statuses) - being_deleted


# A deployment that stops getting closer to running fails its setup this many seconds after its last
# step (a replica placed, started, stopped or changed state), naming itself and Serve's reason: a
# replica that cannot be placed, one that keeps failing. Serve's own wait has no bound, and the test
# waited out pytest's 600 s. A replica whose constructor is running (loading a model, slowly on a
# loaded box) has REPLICA_START_S instead: Serve says so in the deployment's message ("...to
# initialize"), as it says "...to be scheduled" of one it cannot place.
DEPLOY_STALL_S = 120
REPLICA_START_S = 300
# The other served waits' bounds, each on a condition polled (wait_until), generous for a loaded 2-core
# box: they end a test that would otherwise hang, they are no verdict on speed (benchmarks/ has those).
DELETE_S = 180  # an application's deletion: every replica stopped (each waits out its graceful shutdown)
REPLICA_RESTART_S = 300  # a killed or stuck replica replaced by a running one
AUTOSCALE_S = 90  # an autoscaled deployment back to its replicas at rest once its load is gone
HEALTHY_AGAIN_S = 180  # an app's /health answering ok again after a fault


def wait_running(apps: list[str]) -> None:
    """Until every application of ``apps`` runs. Fails at once when one failed to deploy, or after
    ``DEPLOY_STALL_S`` without a step (``REPLICA_START_S`` while a replica's constructor runs), naming
    each deployment not running, its replicas' states and Serve's message."""
    from ray import serve

    last, last_step = None, time.monotonic()
    while True:
        statuses = serve.status().applications
        now = {name: statuses.get(name) for name in apps}
        if all(app is not None and app.status == "RUNNING" for app in now.values()):
            return
        failed = [name for name, app in now.items() if app is not None and app.status == "DEPLOY_FAILED"]
        assert not failed, f"failed to deploy: {_not_running(now)}"
        steps = {name: app and (app.status, {deployment: (status.status, status.replica_states)
                                             for deployment, status in app.deployments.items()})
                 for name, app in now.items()}
        if steps != last:
            last, last_step = steps, time.monotonic()
        initializing = any("to initialize" in (status.message or "") for app in now.values() if app is not None
                           for status in app.deployments.values())
        bound = REPLICA_START_S if initializing else DEPLOY_STALL_S
        assert time.monotonic() - last_step < bound, f"not running, no step for {bound} s: {_not_running(now)}"
        time.sleep(0.5)


def _not_running(apps: dict) -> str:
    """Each application and deployment of ``apps`` that does not run: its status, replicas and Serve's message."""
    lines = []
    for name, app in apps.items():
        if app is None:
            lines.append(f"{name}: not known to Serve")
            continue
        lines.extend(f"{name}/{deployment}: {status.status} {dict(status.replica_states)} {status.message}".strip()
                     for deployment, status in app.deployments.items() if status.status != "HEALTHY")
        if app.message:
            lines.append(f"{name}: {app.status} {app.message}")
    return "; ".join(lines) or "(every deployment healthy)"


def kept_app(name: str, build, route_prefix: str | None = None) -> str:
    """The shared session's application ``name`` (at ``route_prefix``, by default "/<name>"),
    deployed by ``build()`` the first time a module asks and kept for the next ones; returns its base URL."""
    return kept_apps({name: (build, route_prefix or f"/{name}")})[name]


def kept_apps(builds: dict) -> dict[str, str]:
    """``kept_app`` for several (name -> (build, route prefix)): the ones not deployed yet are
    deployed together (``deploy``); returns each one's base URL."""
    url = shared_url()
    missing = {name: build() for name, (build, _) in builds.items() if name not in _shared["kept"]}
    if missing:
        deploy(missing, {name: prefix for name, (_, prefix) in builds.items()})
        _shared["kept"].update(missing)
    return {name: f"{url}{prefix}" for name, (_, prefix) in builds.items()}


# The OpenAI dialect's pair, kept across its modules: "<base>/pd" (PD, with the embedder, every
# prompt through P) and "<base>/co" (colocated), both of tiny-llama as served by default.
# max_iter_times: a tool call in tiny-llama's 1k vocabulary takes ~70 tokens.
OPENAI_APPS_CAP = 160
# The Batch API's bounds and keys on the kept pair (tests/test_batch_api.py): small, so that a test
# can exceed them; the lease short, so that a restarted ingress goes on with a batch within seconds.
BATCH_LIMITS = {"max_file_bytes": 16384, "max_batch_lines": 64, "batch_lease_s": 2.0}
RATE_LIMITED_KEYS = {"two-a-minute": {"key": "sk-two", "rpm": 2}, "few-tokens": {"key": "sk-few", "tpm": 8},
                     "batch-key": {"key": "sk-batch", "rpm": 100000}, "other": {"key": "sk-other", "rpm": 100000}}


def openai_apps() -> str:
    """The base URL under which the kept OpenAI pair answers at "/pd" and "/co"."""
    from deployments.app import colocated_app, pd_app

    common = {"torch_threads": 1, "max_iter_times": OPENAI_APPS_CAP, "pd_local_prefill_tokens": 0, **BATCH_LIMITS,
              "rate_limits": {"keys": RATE_LIMITED_KEYS}}
    kept_apps({"openai-pd": (lambda: pd_app(common), "/openai/pd"),
               "openai-co": (lambda: colocated_app({**common, "embeddings": False}), "/openai/co")})
    return f"{shared_url()}/openai"


# The agent-era dialects' app (Responses, Messages), kept across their modules: PD in float32 (exact
# greedy answers to compare with chat's), no embedder, every prompt through P. max_iter_times: a call
# with an enum argument takes ~40 of tiny-llama's tokens.
AGENT_APP_CAP = 96


def agents_app() -> str:
    """The base URL of the kept agents app ("/agents")."""
    from deployments.app import pd_app

    args = {"torch_threads": 1, "max_iter_times": AGENT_APP_CAP, "dtype": "float32", "embeddings": False,
            "pd_local_prefill_tokens": 0}
    return kept_app("agents", lambda: pd_app(args))


def shared_url() -> str:
    """The base URL of the suite's shared Ray + Serve, started now if it does not run."""
    if _shared["url"] is None:
        _shared["url"] = _start_ray_and_serve(SUITE_CPUS, None)
    return _shared["url"]


def stop_shared_session() -> None:
    """Shut the suite's shared Ray + Serve down, if it runs (a module about to start its own, or the end)."""
    if _shared["url"] is not None:
        _shared["url"] = None
        _shared["kept"].clear()
        _shared["deleting"].clear()
        _stop_ray_and_serve()


def _start_ray_and_serve(num_cpus: int, address: str | None) -> str:
    import ray

    if address is None:
        # "local": a Ray of this process's own even where /tmp/ray/ray_current_cluster names another
        # (a multi-node or GCS test's Cluster on the other xdist worker writes it: tests/workers.py)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        return _start_proxy()
    except BaseException:
        _stop_ray_and_serve(ours=address is None)
        raise


def _start_proxy() -> str:
    """Serve's HTTP proxy on a free loopback port; another port when this one was taken first."""
    import ray
    from ray import serve

    for attempt in range(1, PROXY_START_ATTEMPTS + 1):
        port = free_port()  # after Ray's own processes have taken theirs
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return f"http://127.0.0.1:{port}"
        except ray.exceptions.RayTaskError as error:
            serve.shutdown()
            if "Failed to bind" not in str(error) or attempt == PROXY_START_ATTEMPTS:
                raise
    raise AssertionError("the last attempt returns or raises")


def _stop_ray_and_serve(ours: bool = True) -> None:
    """Disconnect from Ray. A local Ray this process started (``ours``) ends with every process of
    it, Serve's included (~1.5 s); ``serve.shutdown`` first would wait for each replica's graceful
    stop (~23 s with a replica Serve could not place, benchmarks/RESULTS.md issue 53 session 2).
    On a cluster of another's, Serve is shut down first: the cluster goes on."""
    import ray
    from ray import serve

    if not ours:
        serve.shutdown()
    ray.shutdown()  # Serve's cached client of this Ray is dropped by the next session's first Serve call


# What a client must never see: Ray's names and texts, process ids, addresses, tracebacks.
RAY_INTERNALS = re.compile(r"ray|actor|pid|worker|traceback|node|\b\d{1,3}(\.\d{1,3}){3}\b", re.IGNORECASE)


def migrations(url: str) -> float:
    """The ingress's count of requests moved after a replica failed (pdserve_request_migrations_total)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^pdserve_request_migrations_total (\S+)$", text, re.MULTILINE).group(1))


def healthy(url: str) -> bool:
    """Whether the app at ``url`` answers /health "ok": serving with every role, not degraded."""
    return httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"


def pd_metric(url: str, name: str, labels: str = "") -> float:
    """A sample of an app's /metrics, ``name{labels}`` (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{name}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def sigkill(process: psutil.Process) -> None:
    """SIGKILL a replica's process and wait (bounded) until it is gone: the fault, proven."""
    process.send_signal(signal.SIGKILL)
    psutil.wait_procs([process], timeout=60)
    assert not process.is_running()


def replicas(deployment: str, app: str) -> set[str]:
    """The names of the live replica actors of ``app``'s ``deployment`` (the suite's shared Ray runs
    other modules' kept apps beside it). A replica's actor name is its full Serve id,
    "SERVE_REPLICA::<app>#<deployment>#<unique id>"."""
    import ray

    part = f"::{app}#{deployment}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if part in a["name"]}


REPLICA_CALL_TIMEOUT_S = 60


def replica_process(name: str) -> psutil.Process:
    """The process of the replica actor ``name`` (Ray's actor table has its pid)."""
    import ray

    actor = ray.get_actor(name, namespace="serve")
    return psutil.Process(ray._private.state.actors(actor._actor_id.hex())["Pid"])


def call_replica(name: str, method: str, *args):
    """Call ``method`` of the one replica actor ``name``, bypassing Serve's routing (a handle would
    send the call to any replica). Goes in by the entry point a handle's call takes
    (``handle_request``, with the metadata naming the method), so the replica runs it as any call."""
    import pickle
    import uuid

    import ray
    from ray.serve._private.common import RequestMetadata

    call_id = uuid.uuid4().hex
    metadata = RequestMetadata(request_id=call_id, internal_request_id=call_id, call_method=method,
                               app_name=name.split("::", 1)[1].split("#")[0])
    actor = ray.get_actor(name, namespace="serve")
    return ray.get(actor.handle_request.remote(pickle.dumps(metadata), *args), timeout=REPLICA_CALL_TIMEOUT_S)


def holdings(deployment: str, app: str) -> dict[str, dict[str, int]]:
    """Every live replica of ``deployment`` asked, one by one, what it holds for requests (KV
    blocks, prefix holds, requests in its engine, open streams: ``_EngineServer.holdings``)."""
    names = replicas(deployment, app)
    assert names, f"{app}/{deployment} has no live replica to read"
    return {name: call_replica(name, "holdings") for name in sorted(names)}


def holding(deployment: str, app: str) -> dict[str, dict[str, int]]:
    """The replicas of ``deployment`` that hold anything, with what they hold ({} when none does)."""
    return {name: held for name, held in holdings(deployment, app).items() if any(held.values())}


def work_done(deployment: str, app: str) -> dict[str, int]:
    """What the replicas of ``deployment`` have done so far, every replica read directly and summed:
    choices ended, prompt tokens computed and looked up in the prefix cache, draft tokens
    verified; and the prefixes they hold now. Unchanged across a call: no replica did any work for it."""
    total = dict.fromkeys(("finished", "prompt_tokens_computed", "prefix_cache_queries", "draft_tokens",
                           "prefix_holds"), 0)
    for name in sorted(replicas(deployment, app)):
        stats = call_replica(name, "stats")
        total["finished"] += sum(stats.finished_by_reason.values())
        total["prompt_tokens_computed"] += stats.prompt_tokens_computed
        total["prefix_cache_queries"] += stats.prefix_cache_queries
        total["draft_tokens"] += stats.spec_decode_num_draft_tokens
        total["prefix_holds"] += stats.prefix_holds
    return total


def assert_nothing_held(deployments: list[str], app: str, timeout_s: float = 60) -> None:
    """Within ``timeout_s`` (cancellations take a step or two to land), no replica of any of
    ``deployments`` holds a block, a prefix, a request or a stream. Fails naming what is held, where."""
    held: dict = {}

    def none_held() -> bool:
        held.clear()
        held.update({name: h for d in deployments for name, h in holding(d, app).items()})
        return not held

    assert wait_until(none_held, timeout_s, interval_s=0.5), f"held after {timeout_s} s: {held}"


def object_store_bytes() -> int:
    """Bytes in the object store of this process's Ray, every node, exact (the memory summary's text
    rounds to MiB). Asked by the Ray's address: found by itself, Ray refuses when a second one runs
    on the machine (the suite runs two, tests/workers.py)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return get_memory_info_reply(state).store_stats.object_store_bytes_used


def processes(deployment: str, app: str = "pd") -> list[psutil.Process]:
    """The live worker processes of this Ray's replicas of ``app``'s deployment. Found through this
    Ray's actor table, not by the processes' titles alone (ray::ServeReplica:<app>:<deployment>):
    a module with a Ray of its own on the other xdist worker (tests/workers.py) may run an app of
    the same name, whose replicas a fault here must never touch."""
    found = []
    for name in replicas(deployment, app):
        try:
            process = replica_process(name)
            if f"ServeReplica:{app}:{deployment}" in " ".join(process.cmdline()):  # alive, not a reused pid
                found.append(process)
        except (ValueError, TypeError, psutil.Error):  # the actor or its process ended meanwhile (a zombie too)
            continue
    return found


@contextlib.contextmanager
def stopped(deployment: str, app: str = "pd", only: psutil.Process | None = None):
    """SIGSTOP every replica of ``deployment`` (or ``only`` that one's process); SIGCONT on the way out."""
    stopped_now = [only] if only else processes(deployment, app)
    assert stopped_now
    for process in stopped_now:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in stopped_now:
            with contextlib.suppress(psutil.NoSuchProcess):  # killed while stopped
                process.send_signal(signal.SIGCONT)


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON objects of a server-sent-event stream, in order."""
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: "):]))
    return events


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype named as the engine reports it ("float32", "bfloat16")."""
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()
