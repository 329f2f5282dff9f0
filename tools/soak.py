"""A bounded chaos soak (issue 30): mixed load, random faults and hostile input at once, against the
failure contract. Nothing lost, nothing leaked.

Deploys the PD app (1 P, 2 D; or ``--app colocated``, 2 engine replicas) in float32, batch-invariant,
with the fault hook on, on loopback. Takes every pool request's fault-free answer (tools/soak_mix.py),
measures capacity with a short closed loop, then offers ``--load`` (0.7) of it open-loop for
``--minutes``: both dialects, every feature the app serves, 10% of clients leaving at random points,
5% hostile inputs, and a fault every ``--fault-every-s`` (tools/soak_faults.py), each proven.
Every answer is checked as it ends; once the load drains, what the replicas hold, Ray's object
store and the processes' RSS outside their KV pools (sampled every ``--rss-every-s``) are checked too
(tools/soak_invariants.py). Prints a JSON summary and a table; exits 1 if an invariant failed.

    python tools/soak.py [--minutes 10] [--app pd|colocated] [--fault-every-s 60] [--out DIR]
"""

from __future__ import annotations

import argparse
from collections import Counter
import concurrent.futures
import json
from pathlib import Path
import random
import re
import sys
import threading
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from engine.execution.model_runner import kv_pool_resident_bytes  # noqa: E402
from tools.soak_faults import FaultInjector, kinds, roles  # noqa: E402
from tools.soak_invariants import RSS_GROWTH_BOUND, check, outcome, reference_key, rss_growth  # noqa: E402
from tools.soak_mix import Record, Work, hostile, pool, reference, send  # noqa: E402
from tests.serving import holding, migrations, object_store_bytes, processes, replicas, wait_until  # noqa: E402

APP = "soak"
HOSTILE_SHARE, DISCONNECT_SHARE = 0.05, 0.10
MAX_IN_FLIGHT = 48  # client threads: an arrival beyond them is counted as not sent, never queued
DRAIN_BOUND_S = 180.0
ANSWERING_EVERY_S = 2.0  # PD: how often the ingress's counts of P and D replicas answering are read
ANSWERING_GAUGES = {"PrefillServer": "pdserve_pd_prefill_replicas_answering",
                    "DecodeServer": "pdserve_pd_decode_replicas_answering"}
GENERATION_ROUTES = ("/infer_token", "/v1/completions", "/v1/chat/completions", "unmatched")  # 413s: "unmatched"


def app_args() -> dict:
    """float32 and batch-invariant: each pool request has one answer, however it is batched or moved.
    D does not reuse its prefix cache for P's prompts: the pool's long prompts repeat, and D would
    soon hold them all and compute them itself, leaving P (and P's faults) nothing to do; short
    prompts are still computed on D."""
    return {"torch_threads": 1, "dtype": "float32", "batch_invariant": True, "embeddings": False,
            "max_iter_times": 160, "stall_timeout_s": 3, "step_timeout_s": 5, "kv_lease_s": 6,
            "pd_decode_prefix_reuse": False}


def replica_options(count: int) -> dict:
    """The fault hook on in the replicas' environment only; health checked every second, so a stuck
    step's replica is replaced in seconds."""
    return {"num_replicas": count, "health_check_period_s": 1, "graceful_shutdown_timeout_s": 2,
            "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"PDSERVE_FAULT_HOOKS": "1"}}}}


def build_app(app_kind: str):
    from deployments.app import colocated_app, pd_app

    if app_kind == "pd":
        return pd_app(app_args(), prefill_options=replica_options(1), decode_options=replica_options(2))
    return colocated_app(app_args(), llm_options=replica_options(2))


def deploy(base_url: str, app_kind: str) -> str:
    """The soak's app under /soak on the running Serve; its URL once /health says it is ready."""
    from ray import serve

    serve.run(build_app(app_kind), name=APP, route_prefix=f"/{APP}")
    url = f"{base_url}/{APP}"
    assert wait_until(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 200, 300, 1), "never healthy"
    return url


def settled_object_store_bytes(bound_s: float = 30.0) -> int:
    """The object store's bytes once the last requests' KV has gone: two reads a second apart agree."""
    reads = [object_store_bytes()]
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        time.sleep(1)
        reads.append(object_store_bytes())
        if reads[-1] == reads[-2]:
            break
    return reads[-1]


def server_statuses(url: str) -> Counter:
    """The ingress's count of generation requests by status (pdserve_requests_total)."""
    counts: Counter = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pdserve_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("endpoint") in GENERATION_ROUTES:
                counts[labels["status"]] += int(float(line.rsplit(" ", 1)[1]))
    return counts


class Soak:
    """The soak's core, importable (tests/test_soak.py runs it for two minutes): references, capacity,
    the open-loop load with faults, the drained checks."""

    def __init__(self, url: str, app_kind: str, seed: int = 0, rss_every_s: float = 30.0, app: str = APP) -> None:
        self.url, self.app_kind, self.app, self.rng = url, app_kind, app, random.Random(seed)
        self.client = httpx.Client(limits=httpx.Limits(max_connections=MAX_IN_FLIGHT + 16))
        self.pool, self.hostile = pool(), hostile()
        self.references: dict[str, dict[int, str]] = {}
        self.records: list[Record] = []
        self.violations: list[tuple[float, str]] = []  # found as each answer ended: (seconds into the load, what)
        self.faults: list[dict] = []
        self.rss: dict[str, list[tuple[float, int]]] = {}
        # PD: role -> (time.monotonic(), that role's replicas answering the ingress's probes)
        self.answering: dict[str, list[tuple[float, int]]] = {role: [] for role in ANSWERING_GAUGES}
        self.rss_every_s, self.lock, self.stopping = rss_every_s, threading.Lock(), threading.Event()
        self.not_sent = 0
        self.t0 = time.monotonic()

    def take_references(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(4) as threads:
            answers = list(threads.map(lambda w: reference(self.client, self.url, w), self.pool))
        refused = [f"{w.name}: {a.status} {a.error}" for w, a in zip(self.pool, answers) if a.status != 200 or a.error]
        assert not refused, f"fault-free answers refused: {refused}"
        self.references = {reference_key(w): a.texts for w, a in zip(self.pool, answers)}

    def capacity(self, seconds: float, concurrency: int = 8) -> float:
        """Pool requests per second a closed loop of ``concurrency`` clients completes."""
        deadline, done = time.monotonic() + seconds, []

        def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                record = send(self.client, self.url, rng.choice(self.pool))
                done.append(record.status == 200)

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as threads:
            list(threads.map(client, range(concurrency)))
        return sum(done) / (time.monotonic() - start)

    # ---- the load ------------------------------------------------------------------------

    def _one(self, work: Work, leave_after: int | None = None, leave_before_s: float | None = None) -> Record:
        record = send(self.client, self.url, work, leave_after=leave_after, leave_before_s=leave_before_s)
        reference = None if work.hostile else self.references[reference_key(work)]
        problems = check(  # the per-answer invariants, at once
            [record], {reference_key(work): reference} if reference else {},
            {"holding": {}, "object_store_baseline": 0, "object_store_after": 0, "rss": {}, "faults": []})
        with self.lock:
            self.records.append(record)
            for name, found in problems.items():
                self.violations += [(round(record.ended_at - self.t0, 1), f"{name}: {v}") for v in found]
        return record

    def next_request(self) -> tuple[Work, int | None, float | None]:
        """A hostile input (5%), else a pool request, 10% of whose clients leave at a random point."""
        if self.rng.random() < HOSTILE_SHARE:
            return self.rng.choice(self.hostile), None, None
        work = self.rng.choice(self.pool)
        if self.rng.random() >= DISCONNECT_SHARE:
            return work, None, None
        if work.stream:
            return work, self.rng.choice([0, 1, 2, 5, 10]), None
        return work, None, self.rng.uniform(0.05, 1.5)

    def migrations_now(self) -> float:
        """The ingress's migration count; the last one read if /metrics does not answer (it asks every replica)."""
        try:
            self._migrations = migrations(self.url)
        except httpx.HTTPError:
            pass
        return self._migrations

    def disconnect_burst(self, count: int) -> int:
        """``count`` streams at once, each client leaving after two events: how many left mid-stream."""
        streams = [w for w in self.pool if w.stream]
        with concurrent.futures.ThreadPoolExecutor(count) as threads:
            records = list(threads.map(lambda w: self._one(w, leave_after=2),
                                       [self.rng.choice(streams) for _ in range(count)]))
        return sum(r.disconnected for r in records)

    def sample_rss(self) -> None:
        import psutil

        for role in ("Ingress", *roles(self.app_kind)):
            for process in processes(role, self.app):
                try:  # the KV pool's pages count apart: they grow up to the pool's size as traffic touches blocks
                    rss = process.memory_info().rss - kv_pool_resident_bytes(process)
                except psutil.Error:
                    continue  # killed meanwhile
                self.rss.setdefault(f"{role}:{process.pid}", []).append((round(time.monotonic() - self.t0, 1), rss))

    def sample_answering(self) -> None:
        """The P and D replicas answering the ingress's probes, as its /metrics says now (0 of one role:
        the other serves alone; the invariant ``no_false_degradation``)."""
        try:
            text = self.client.get(f"{self.url}/metrics", timeout=30).text
        except httpx.HTTPError:
            return
        for role, gauge in ANSWERING_GAUGES.items():
            found = re.search(rf"^{gauge}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
            if found:
                self.answering[role].append((time.monotonic(), int(float(found.group(1)))))

    def run(self, seconds: float, rate: float, fault_every_s: float, fault_kinds: list[str]) -> None:
        """Open-loop arrivals at ``rate``/s for ``seconds``, a fault every ``fault_every_s`` (kinds in a
        seeded shuffled cycle: each once before any twice), RSS sampled; then waits for the answers."""
        self.t0, end = time.monotonic(), time.monotonic() + seconds
        self.migrations_at_start = self._migrations = migrations(self.url)
        cycle = self.rng.sample(fault_kinds, len(fault_kinds))
        injector = FaultInjector(self.url, self.app, self.app_kind, random.Random(self.rng.random()),
                                 self.disconnect_burst)
        self.full = injector.full

        def faults() -> None:  # fault i at (i + 1) * fault_every_s into the load, none in its last 10 s
            while not self.stopping.wait(max(0.0, self.t0 + fault_every_s * (len(self.faults) + 1) - time.monotonic())) \
                    and time.monotonic() < end - 10:
                kind = cycle[len(self.faults) % len(cycle)]
                try:
                    fault = injector.inject(kind)
                except Exception as error:  # an injection that failed is a fault not proven
                    fault = {"kind": kind, "at": time.monotonic(), "until": time.monotonic(), "proven": False,
                             "proof": f"injection failed: {error!r}"}
                fault["migrations_after"] = self.migrations_now()  # the ingress counts a move as its request ends
                self.faults.append(fault)

        def rss() -> None:
            while not self.stopping.is_set():
                self.sample_rss()
                self.stopping.wait(self.rss_every_s)

        def answering() -> None:
            while self.app_kind == "pd" and not self.stopping.wait(ANSWERING_EVERY_S):
                self.sample_answering()

        background = [threading.Thread(target=f, daemon=True) for f in (faults, rss, answering)]
        for thread in background:
            thread.start()
        in_flight = threading.Semaphore(MAX_IN_FLIGHT)
        with concurrent.futures.ThreadPoolExecutor(MAX_IN_FLIGHT) as threads:
            arrival = time.monotonic()
            while arrival < end:
                time.sleep(max(0.0, arrival - time.monotonic()))
                work, leave_after, leave_before_s = self.next_request()
                if in_flight.acquire(blocking=False):
                    future = threads.submit(self._one, work, leave_after, leave_before_s)
                    future.add_done_callback(lambda _: in_flight.release())
                else:
                    self.not_sent += 1
                arrival += self.rng.expovariate(rate)
            self.stopping.set()
        for thread in background:
            thread.join(timeout=DRAIN_BOUND_S)
        self.duration_s = time.monotonic() - self.t0

    # ---- after the load ------------------------------------------------------------------

    def drained(self, object_store_baseline: int, statuses_before: Counter) -> dict:
        """What the invariants read once the load is over: the roles whole again, then every replica's
        holdings, the object store and the ingress's counts (each waited for, bounded)."""
        role_names = roles(self.app_kind)
        wait_until(lambda: all(len(replicas(r, self.app)) >= self.full[r] for r in role_names), DRAIN_BOUND_S, 1)
        held: dict = {}

        def nothing_held() -> bool:
            held.clear()
            try:
                held.update({name: h for role in role_names for name, h in holding(role, self.app).items()})
            except Exception as error:  # a replica being replaced: read again
                held["(not read)"] = {"error": repr(error)}
            return not held

        wait_until(nothing_held, 120, 0.5)
        wait_until(lambda: object_store_bytes() <= object_store_baseline, 60, 1)
        self.sample_rss()
        statuses = server_statuses(self.url)
        return {"holding": held, "object_store_baseline": object_store_baseline,
                "object_store_after": object_store_bytes(), "rss": self.rss, "faults": self.faults,
                "server_statuses": statuses - statuses_before, "answering": self.answering}


def run_soak(url: str, app_kind: str, seconds: float, fault_every_s: float, seed: int = 0, load: float = 0.7,
             capacity_s: float = 20.0, rss_every_s: float = 30.0, fault_kinds: list[str] | None = None,
             app: str = APP) -> dict:
    """The whole soak against the Serve app ``app`` at ``url`` (its fault hook on): its summary,
    ``invariants`` mapping each to its violations (empty: it held)."""
    soak = Soak(url, app_kind, seed, rss_every_s, app)
    soak.take_references()
    capacity = soak.capacity(capacity_s)
    baseline, statuses_before = settled_object_store_bytes(), server_statuses(url)
    soak.run(seconds, load * capacity, fault_every_s, fault_kinds or kinds(app_kind))
    drained = soak.drained(baseline, statuses_before)
    invariants = check(soak.records, soak.references, drained)
    invariants["checked_as_they_ended"] = [f"{t} s: {v}" for t, v in soak.violations]
    return summarize(soak, capacity, load, drained, invariants)


def summarize(soak: Soak, capacity: float, load: float, drained: dict, invariants: dict) -> dict:
    windows = [(f, f["at"], f["until"] + 10.0) for f in soak.faults]  # a fault's effects: its window + 10 s

    def fault_of(record: Record) -> str:
        hit = [f["kind"] for f, start, stop in windows if record.sent_at <= stop and record.ended_at >= start]
        return hit[0] if hit else "none"

    rows: dict[str, Counter] = {}
    ttft = {"during faults": [], "outside faults": []}
    for r in soak.records:
        kind = fault_of(r)
        verdict = outcome(r, None if r.work.hostile else soak.references[reference_key(r.work)])
        rows.setdefault(kind, Counter()).update({"sent": 1, verdict: 1})
        if r.ttft_s is not None and not r.work.hostile and r.status == 200:
            ttft["during faults" if kind != "none" else "outside faults"].append(r.ttft_s)
    for i, f in enumerate(soak.faults):  # moves counted from the fault's start to its end (its requests ended)
        before = soak.faults[i - 1]["migrations_after"] if i else soak.migrations_at_start
        rows.setdefault(f["kind"], Counter())["migrated"] += f["migrations_after"] - before
        f["longest_wait_s"] = longest_wait_s(f, soak.records)
    return {
        "app": soak.app_kind, "duration_s": round(soak.duration_s, 1), "capacity_rps": round(capacity, 2),
        "offered_rps": round(load * capacity, 2), "sent": len(soak.records), "not_sent_client_bound": soak.not_sent,
        "hostile": sum(bool(r.work.hostile) for r in soak.records),
        "by_fault": {k: dict(v) for k, v in rows.items()},
        "faults": [{k: v for k, v in f.items() if k not in ("at", "until")} | {"at_s": round(f["at"] - soak.t0, 1)}
                   for f in soak.faults],
        "p99_ttft_ms": {k: round(float(np.percentile(v, 99)) * 1000, 1) if v else None for k, v in ttft.items()},
        "rss_mib": {name: [(t, round(b / 2**20, 1)) for t, b in rows_] for name, rows_ in drained["rss"].items()},
        "rss_growth": {k: round(v, 4) for k, v in rss_growth(drained["rss"]).items()},
        "object_store_bytes": [drained["object_store_baseline"], drained["object_store_after"]],
        "invariants": invariants, "passed": not any(invariants.values()),
    }


def longest_wait_s(fault: dict, records: list[Record]) -> float | None:
    """For a stall (SIGSTOP, a stuck step): the longest any request waited, across the stall, for its
    next event (its first, for one sent during it; its answer, for a whole one): how long the stall
    held a client before it was detected and the request moved (or the replica ran again)."""
    if not fault["kind"].startswith(("SIGSTOP", "stuck")):
        return None
    waits = []
    for r in records:
        times = [r.sent_at, *r.event_times] if r.event_times else [r.sent_at, r.ended_at]
        waits += [b - a for a, b in zip(times, times[1:]) if a <= fault["until"] and b >= fault["at"]]
    return round(max(waits), 2) if waits else None


def table(summary: dict) -> str:
    columns = ("sent", "completed", "migrated", "clean_error", "refused", "deadline", "disconnected", "rejected",
               "lost")
    lines = ["| fault | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 1)]
    for kind, row in summary["by_fault"].items():
        lines.append(f"| {kind} | " + " | ".join(f"{row.get(c, 0):g}" for c in columns) + " |")
    return "\n".join(lines)


def write_rss(summary: dict, out: Path) -> Path:
    """RSS over time: a PNG (matplotlib is a benchmark dependency), one line per process."""
    from tools.plots import plt, _save

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, rows in summary["rss_mib"].items():
        ax.plot([t for t, _ in rows], [m for _, m in rows], "o-", label=name)
    ax.set(title="RSS during the soak", xlabel="seconds into the load", ylabel="MiB")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    return _save(fig, out / "soak_rss.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--app", choices=("pd", "colocated"), default="pd")
    parser.add_argument("--fault-every-s", type=float, default=60)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity offered")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args()
    from tests.serving import serve_session

    with serve_session() as base_url:
        url = deploy(base_url, args.app)
        summary = run_soak(url, args.app, args.minutes * 60, args.fault_every_s, args.seed, args.load)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(table(summary))
    print(f"RSS plot: {write_rss(summary, args.out)}; RSS growth bound {RSS_GROWTH_BOUND:.0%}")
    print("PASSED" if summary["passed"] else "FAILED: " + ", ".join(k for k, v in summary["invariants"].items() if v))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
