"""The soak's invariants (issue 30, part 4), checked on what the clients saw and what the server
holds once the load has drained. Each check returns its violations, named; none means it holds.

- ``ends_exactly_once``: each answered request has one end marker and nothing after it, each choice
  one finish reason; the ingress counted each HTTP request once (its counter by status against the
  clients' statuses).
- ``matches_fault_free``: a completed request's answer is its fault-free reference; one that ended
  with a clean error, by its deadline, or whose client left, delivered a prefix of it.
- ``nothing_lost``: no hang, no reset the client did not cause, no unexpected status, no wrong text.
- ``hostile_never_5xx``: every hostile input got a 4xx.
- ``no_raw_internals``: no error body or error event names Ray, a pid, an address or a traceback.
- ``replicas_hold_nothing``: every P, D (or colocated) replica holds no block, prefix, request or stream.
- ``object_store_at_baseline``: Ray's object store is back to its bytes before the load.
- ``rss_growth_bounded``: each process's RSS outside its KV pool (a bound the user set, resident as
  traffic touches it: engine/execution/model_runner.py ``zeroed_kv_pool``) after its warm-up grew at
  most ``RSS_GROWTH_BOUND``.
- ``faults_proven``: each injected fault has its proof.
- ``no_false_degradation``: PD never fell back to one role alone (no P, or no D, replica answering
  the ingress's probes, as /metrics said) outside a fault on that role and ``DEGRADATION_GRACE_S``
  after it: a burst on a loaded box must not call live replicas down (issue 55).
"""

from __future__ import annotations

from collections import Counter

from tests.serving import RAY_INTERNALS
from tools.soak_mix import Record

CLEAN_ERROR_CODES = {"replica_unavailable", "engine_timeout", "timeout"}  # docs/serving.md's failure table
RSS_GROWTH_BOUND = 0.10
OBJECT_STORE_SLACK_BYTES = 64 << 10  # below one long prompt's KV (> 100 KiB)
DEGRADATION_GRACE_S = 10.0  # a fault's effect on its role's answers: its window and this long after


def is_prefix(texts: dict[int, str], reference: dict[int, str]) -> bool:
    return set(texts) <= set(reference) and all(reference[i].startswith(t) for i, t in texts.items())


def outcome(record: Record, reference: dict[int, str] | None) -> str:
    """completed, clean_error, refused (503 overloaded), deadline, disconnected, rejected (a hostile
    input's 4xx), or lost."""
    if record.work.hostile:
        return "rejected" if record.status and 400 <= record.status < 500 else "lost"
    if record.disconnected:
        return "disconnected" if is_prefix(record.texts, reference) else "lost"
    if record.failure or record.status is None:
        return "lost"
    if record.status != 200:
        if record.status == 503 and record.error_code == "overloaded":
            return "refused"
        return "clean_error" if record.status in (408, 503, 504) and record.error_code in CLEAN_ERROR_CODES \
            else "lost"
    if record.error:
        return "clean_error" if is_prefix(record.texts, reference) else "lost"
    if record.texts == reference:
        return "completed"
    return "deadline" if record.work.deadline and is_prefix(record.texts, reference) else "lost"


def ends_exactly_once(records: list[Record], server_statuses: Counter | None) -> list[str]:
    out = []
    for r in records:
        if r.status is None or r.disconnected:
            continue
        if r.terminals != 1 or r.after_terminal:
            out.append(f"{r.work.name}: {r.terminals} end markers, {r.after_terminal} events after the end")
        if r.status == 200 and not r.error and any(len(f) != 1 for f in r.finishes.values()):
            out.append(f"{r.work.name}: finish reasons per choice {r.finishes}")
    if server_statuses is not None:
        seen = Counter(str(r.status) for r in records if r.status is not None)
        unknown = sum(r.status is None for r in records)  # left before the headers: counted or not
        for status, count in seen.items():
            if server_statuses.get(status, 0) < count:
                out.append(f"status {status}: the clients saw {count}, the ingress counted {server_statuses.get(status, 0)}")
        extra = sum(server_statuses.values()) - sum(seen.values())
        if extra > unknown:
            out.append(f"the ingress counted {extra} requests more than the clients saw answered ({unknown} unanswered)")
    return out


def matches_fault_free(records: list[Record], references: dict[str, dict[int, str]]) -> list[str]:
    return [f"{r.work.name}: {r.texts!r} is not {references[_key(r)]!r}" for r in records
            if not r.work.hostile and r.status == 200 and outcome(r, references[_key(r)]) == "lost"
            and not r.failure]


def nothing_lost(records: list[Record], references: dict[str, dict[int, str]]) -> list[str]:
    return [f"{r.work.name}: status {r.status}, failure {r.failure}, error {r.error!r}" for r in records
            if not r.work.hostile and outcome(r, references[_key(r)]) == "lost"]


def hostile_never_5xx(records: list[Record]) -> list[str]:
    return [f"{r.work.hostile}: status {r.status} {r.failure or ''} {r.error_body[:200]!r}" for r in records
            if r.work.hostile and outcome(r, None) != "rejected"]


def no_raw_internals(records: list[Record]) -> list[str]:
    return [f"{r.work.name}: {r.error_body[:300]!r}" for r in records if RAY_INTERNALS.search(r.error_body)]


def replicas_hold_nothing(holding: dict[str, dict[str, int]]) -> list[str]:
    """``holding``: each replica that holds anything, with what (tests/serving.py ``holding``)."""
    return [f"{name}: {held}" for name, held in holding.items()]


def object_store_at_baseline(baseline: int, after: int) -> list[str]:
    if after > baseline + OBJECT_STORE_SLACK_BYTES:
        return [f"object store {after} bytes after the load, {baseline} before"]
    return []


def rss_growth(samples: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
    """Per process, its last RSS over its first sample after warm-up (its second: the first is taken
    while it may still be loading), minus one; processes with fewer than three samples are skipped."""
    return {name: rows[-1][1] / rows[1][1] - 1.0 for name, rows in samples.items() if len(rows) >= 3}


def rss_growth_bounded(samples: dict[str, list[tuple[float, int]]]) -> list[str]:
    return [f"{name}: RSS grew {growth:.1%} after warm-up" for name, growth in rss_growth(samples).items()
            if growth > RSS_GROWTH_BOUND]


def faults_proven(faults: list[dict]) -> list[str]:
    return [f"{f['kind']}: not proven ({f.get('proof')})" for f in faults if not f.get("proven")]


def no_false_degradation(samples: dict[str, list[tuple[float, int]]], faults: list[dict]) -> list[str]:
    """``samples``: role -> (time.monotonic(), that role's replicas answering) read from the ingress's
    /metrics during the load; a 0 outside every window of a fault on that role is a false degradation."""
    found = []
    for role, readings in samples.items():
        windows = [(f["at"], f["until"] + DEGRADATION_GRACE_S) for f in faults if f["kind"].endswith(role)]
        found += [f"no {role} replica answering at {at:.1f} (monotonic s), no fault on {role} then"
                  for at, answering in readings if answering == 0 and not any(lo <= at <= hi for lo, hi in windows)]
    return found


def _key(record: Record) -> str:
    return reference_key(record.work)


def reference_key(work) -> str:
    """A legitimate request's key in the references: its feature and body."""
    return f"{work.name}|{work.path}|{sorted(work.body.items()) if isinstance(work.body, dict) else work.body}"


def check(records: list[Record], references: dict[str, dict[int, str]], drained: dict) -> dict[str, list[str]]:
    """Every invariant, each with its violations. ``drained``: read once the load ended: ``holding``,
    ``object_store_baseline``, ``object_store_after``, ``rss``, ``faults``, ``server_statuses``."""
    return {
        "ends_exactly_once": ends_exactly_once(records, drained.get("server_statuses")),
        "matches_fault_free": matches_fault_free(records, references),
        "nothing_lost": nothing_lost(records, references),
        "hostile_never_5xx": hostile_never_5xx(records),
        "no_raw_internals": no_raw_internals(records),
        "replicas_hold_nothing": replicas_hold_nothing(drained["holding"]),
        "object_store_at_baseline": object_store_at_baseline(drained["object_store_baseline"],
                                                             drained["object_store_after"]),
        "rss_growth_bounded": rss_growth_bounded(drained["rss"]),
        "faults_proven": faults_proven(drained["faults"]),
        "no_false_degradation": no_false_degradation(drained.get("answering", {}), drained["faults"]),
    }
