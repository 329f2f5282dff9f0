"""Where a served app's start-up goes: one PD app of tiny-llama, deployed as the tests deploy it
(tests/serving.py: the suite's Ray of SUITE_CPUS logical CPUs, Serve's proxy, ``pd_app`` with one torch
thread per engine, every prompt through P).

    flock /tmp/pdserve-heavy.lock timeout 600 env PYTHONPATH=$PWD python benchmarks/replica_start.py [--no-embeddings]

Two passes, each in a fresh interpreter: the environment as it is, then with the suite's cache of
compiled modules (tests/bytecode.py, warmed first: what every process after the suite's first ones
finds). Each phase is measured where it is a process's own cost:

- **imports**, each in a fresh interpreter (as a replica's process starts bare): ``ray.serve`` (what every
  Serve replica imports before any of ours), ``deployments.replicas.servers`` (P and D),
  ``deployments.ingress.ingress`` (the ingress), ``deployments.replicas.embeddings`` (the embedder), and
  the packages that weigh most in them (``python -X importtime``'s self times summed by top-level package);
- **the engine's build** in a fresh interpreter after the servers' imports: transformers' config classes
  (their first use imports torch's compiler stack), then ``AsyncEngine(config)`` of the served engine config
  split into the model's load, the runner (the attention kernel's load), its warm-up and the rest;
- **served**: ``ray.init``, ``serve.start``, the app's deploy until Serve says RUNNING (polled every 50 ms),
  and for each replica, from Serve's logs, its process start and imports (the controller's "Starting
  Replica" to the replica's "Started initializing replica") and its constructor (to "Finished
  initializing"), and the CPU seconds its process had used when the app ran; then the CPU seconds of
  Ray's and Serve's own processes, and the way out: the app's delete, ``serve.shutdown``, ``ray.shutdown``.

On a 2-core box the replicas start side by side and share both cores, so each replica's wall time is
about its CPU time times the replicas starting at once; the CPU seconds are the phases' real cost.
"""

from __future__ import annotations

import argparse
import collections
from datetime import datetime
import json
import os
from pathlib import Path
import re
import resource
import subprocess
import sys
import time

import psutil

from tests.bytecode import keep_compiled_modules

REPO = Path(__file__).resolve().parents[1]
# The modules each kind of replica's process imports when Serve unpickles its class.
REPLICA_IMPORTS = {"ray.serve": "every Serve replica, before ours", "deployments.replicas.servers": "P and D",
                   "deployments.ingress.ingress": "the ingress", "deployments.replicas.embeddings": "the embedder"}
SERVE_PROCESSES = ["ray.serve._private.controller", "ray.serve._private.proxy", "ray.serve._private.replica"]
APP_ARGS = {"torch_threads": 1, "pd_local_prefill_tokens": 0}  # as the tests' apps (tests/serving.py)
POLL_S = 0.05


def import_seconds(module: str) -> dict:
    """Wall and CPU seconds to import ``module`` in a fresh interpreter (the interpreter's own start
    included), and its heaviest packages by self time."""
    started, cpu = time.perf_counter(), _children_cpu()
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    wall, cpu = time.perf_counter() - started, _children_cpu() - cpu
    by_package: collections.Counter = collections.Counter()
    for line in result.stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[0].strip().isdigit():
            by_package[fields[2].strip().split(".")[0]] += int(fields[0])
    return {"wall_s": wall, "cpu_s": cpu, "top": [(name, us / 1e6) for name, us in by_package.most_common(8)]}


def engine_phases() -> dict:
    """In this (fresh) interpreter, CPU seconds (the engine runs one torch thread, as served): the
    servers' imports, transformers' config classes, then the engine's build split into its parts (each
    part's function timed where the engine calls it)."""
    timings: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                timings[label] += time.process_time() - started
        setattr(owner, name, wrapper)

    started = time.process_time()
    import deployments.replicas.servers  # noqa: F401  (what a P or D replica imports first)
    timings["imports (deployments.replicas.servers)"] = time.process_time() - started

    from transformers import AutoConfig

    from deployments.config import AppArgs
    from engine import llm_engine
    from engine.async_engine import AsyncEngine
    from engine.execution.loader import resolve_model_dir

    args = AppArgs.model_validate(APP_ARGS)
    config = args.engine_config(args.model)
    started = time.process_time()
    AutoConfig.from_pretrained(resolve_model_dir(config.model), local_files_only=True)
    timings["transformers' config classes (first AutoConfig)"] = time.process_time() - started
    timed(llm_engine, "load_model", "model load (weights, tokenizer)")
    timed(llm_engine.ModelRunner, "__init__", "runner (KV pool, attention kernel load)")
    timed(llm_engine.ModelRunner, "warm_up", "warm-up forward")
    timed(llm_engine, "GrammarCompiler", "grammar compiler (llguidance tokenizer)")
    started = time.process_time()
    engine = AsyncEngine(config)
    total = time.process_time() - started
    engine.shutdown()
    timings["engine, the rest (scheduler, pools, engine thread)"] = total - sum(
        seconds for label, seconds in timings.items() if not label.startswith(("imports", "transformers")))
    return {"phases": dict(timings), "engine_total_s": total}  # CPU seconds


def served(embeddings: bool) -> dict:
    """Ray, Serve, and one PD app's deploy, with each replica's phases read from Serve's logs."""
    started = time.perf_counter()
    import ray
    from ray import serve

    from tests.serving import SUITE_CPUS, free_port, replica_process, replicas
    result: dict = {"import ray, serve (driver)": time.perf_counter() - started}
    own = psutil.Process()  # Ray's processes are its children: GCS, raylet, agents, workers
    started = time.perf_counter()
    ray.init(num_cpus=SUITE_CPUS, include_dashboard=False, log_to_driver=False)
    result["ray.init"] = time.perf_counter() - started
    started = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    result["serve.start"] = time.perf_counter() - started
    try:
        from deployments.app import pd_app

        started = time.perf_counter()
        app = pd_app({**APP_ARGS, "embeddings": embeddings})
        result["pd_app (driver: the app's graph, model fingerprint)"] = time.perf_counter() - started
        started = time.perf_counter()
        serve.run_many([serve.RunTarget(target=app, name="pd", route_prefix="/pd")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        while (status := serve.status().applications["pd"]).status != "RUNNING":
            assert status.status != "DEPLOY_FAILED", status
            time.sleep(POLL_S)
        result["deploy until RUNNING"] = time.perf_counter() - started
        deployments = ["Ingress", "PrefillServer", "DecodeServer"] + (["EmbeddingServer"] if embeddings else [])
        processes = {deployment: replica_process(name) for deployment in deployments
                     for name in replicas(deployment, "pd")}  # one replica each
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        result["replicas"] = replica_phases(session / "logs" / "serve",
                                            {deployment: _cpu(p) for deployment, p in processes.items()})
        pids = {p.pid for p in processes.values()}
        result["Ray's and Serve's own processes, CPU s"] = sum(
            _cpu(p) for p in own.children(recursive=True) if p.pid not in pids)
        started = time.perf_counter()
        serve.delete("pd")  # what a module's way out does on the suite's shared Ray (tests/serving.py)
        result["serve.delete of the app"] = time.perf_counter() - started
    finally:
        started = time.perf_counter()
        serve.shutdown()
        result["serve.shutdown"] = time.perf_counter() - started
        started = time.perf_counter()
        ray.shutdown()
        result["ray.shutdown"] = time.perf_counter() - started
    return result


def replica_phases(logs: Path, cpu: dict[str, float]) -> dict:
    """Per deployment: the controller's "Starting Replica" to the replica's "Started initializing
    replica" (its process's start and imports), then to "Finished initializing replica" (the constructor)."""
    stamp = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
    (controller,) = logs.glob("controller_*.log")
    starting = {}
    for line in controller.read_text().splitlines():
        if found := re.search(r"Starting Replica\(id='(\w+)', deployment='(\w+)', app='pd'\)", line):
            starting[found.group(1)] = (found.group(2), _when(stamp, line))
    phases = {}
    for replica_id, (deployment, start) in starting.items():
        (log,) = logs.glob(f"replica_pd_{deployment}_{replica_id}.log")
        marks = {}
        for line in log.read_text().splitlines():
            for mark in ("Started initializing replica", "Finished initializing replica"):
                if mark in line:
                    marks[mark] = _when(stamp, line)
        phases[deployment] = {
            "process start + imports": (marks["Started initializing replica"] - start).total_seconds(),
            "constructor": (marks["Finished initializing replica"] - marks["Started initializing replica"]
                            ).total_seconds(),
            "process CPU s": cpu[deployment]}
    return phases


def _when(stamp: re.Pattern, line: str) -> datetime:
    return datetime.strptime(stamp.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def measure(embeddings: bool) -> None:
    """One pass: the imports, the engine's build and the served app, as this process's environment has them."""
    kept = os.environ.get("PYTHONPYCACHEPREFIX") or ("not kept" if sys.dont_write_bytecode else "beside the sources")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {psutil.getloadavg()[0]:.1f}, "
          f"{psutil.cpu_count()} logical CPUs, compiled modules: {kept}")
    print("\n## imports, each in a fresh interpreter (wall s, CPU s; heaviest packages by self wall time, s)")
    for module, who in REPLICA_IMPORTS.items():
        found = import_seconds(module)
        top = ", ".join(f"{name} {seconds:.2f}" for name, seconds in found["top"])
        print(f"{module:32s} {found['wall_s']:6.2f} {found['cpu_s']:6.2f}  ({who}) {top}")
    print("\n## the engine's build, in a fresh interpreter (CPU s)")
    child = subprocess.run([sys.executable, __file__, "--child", "engine"], cwd=REPO, capture_output=True,
                           text=True, check=True)
    engine = json.loads(child.stdout.splitlines()[-1])
    for label, seconds in engine["phases"].items():
        print(f"{label:55s} {seconds:6.2f}")
    print(f"{'AsyncEngine(config), all of it':55s} {engine['engine_total_s']:6.2f}")
    print(f"\n## served: one PD app {'with' if embeddings else 'without'} its embedder (s)")
    result = served(embeddings)
    for label, value in result.items():
        if label != "replicas":
            print(f"{label:55s} {value:6.2f}")
    print(f"{'replica':16s} {'process start + imports':>24s} {'constructor':>12s} {'process CPU s':>14s}")
    for deployment, phases in result["replicas"].items():
        print(f"{deployment:16s} {phases['process start + imports']:24.2f} {phases['constructor']:12.2f} "
              f"{phases['process CPU s']:14.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-embeddings", action="store_true", help="the app without its embedder (as most tests')")
    parser.add_argument("--child", choices=["engine", "as-is", "cached"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "engine":
        print(json.dumps(engine_phases()))
    elif args.child == "cached":
        keep_compiled_modules()
        for module in [*REPLICA_IMPORTS, *SERVE_PROCESSES]:  # the cache warm, as after the suite's first start
            subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, check=True)
        measure(not args.no_embeddings)
    elif args.child == "as-is":
        measure(not args.no_embeddings)
    else:  # both passes, each in a fresh interpreter: the environment as it is, then the suite's cache
        for child in ("as-is", "cached"):
            subprocess.run([sys.executable, __file__, "--child", child, *sys.argv[1:]], cwd=REPO, check=True)
            print(flush=True)


if __name__ == "__main__":
    main()
