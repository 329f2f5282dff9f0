"""Which replica of an engine deployment takes a call: prefix affinity weighed against load.

``EngineRouter`` is the Ray Serve request router of P, D and the colocated engine; it runs in
the ingress's process. For a call:

0. a request's call only to a replica the compatibility check paired (deployments/pd/compatibility.py),
   but for calls pinned to another; calls with no request (the ingress's probes, info, stats) to any;
1. pinned to a replica (the ``pinned`` keyword: D's decode and local prefill go to the D replica
   that said how much of the prompt it holds, deployments/pd/backends.py): that replica;
2. else, among the replicas no stream found stalled (deployments/replicas/liveness.py), the one that was
   sent the most of the prompt's start (a prefix index per deployment, as Ray Serve LLM's
   prefix-aware router and SGLang's router keep one), the less loaded of equals; with the app's
   prefix store on (P, deployments/replicas/prefix_store.py), a prompt's start that some P was sent
   is in the store too (P publishes what it computed), and counts for every replica at
   ``STORE_WEIGHT`` of a token in its own pool: below "in my pool" (a pull costs a copy), above
   nothing (no compute); unless the
   replicas' loads differ by more than a bound, when the least loaded comes first (Ray Serve
   LLM's rule). Load is what the replica last reported (``record_routing_stats``: P's queued
   prompt tokens; D's and colocated's running and waiting requests) plus what this process sent
   it since. Ties are broken at random; the other replicas follow, best first, so Serve falls
   back to them when the first is full.

A choice that finds no replica is retried by Serve after a growing back-off (never in a tight loop:
``choose_replicas`` says so on every call).

The index is a guess (a replica may have evicted a prefix since); D's own answer is exact, and is
what P's export starts from. Priority is not the router's concern: every replica takes up to
``max_ongoing_requests`` calls at once, and each engine's scheduler orders them by priority.
"""

from __future__ import annotations

from collections import OrderedDict
import hashlib
import random
import time

import numpy as np
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from engine.request import GenerationRequest

AFFINITY_BLOCK = 16  # tokens per index entry (the engines' default block size)
INDEX_ENTRIES = 1 << 17  # entries kept per deployment, least recently used forgotten first
PREFILL_IMBALANCE_TOKENS = 4096  # P: past this spread of queued prompt tokens, load decides before affinity
IMBALANCE_REQUESTS = 8  # D and colocated: past this spread of requests, load decides before affinity
STATS_PERIOD_S = 0.5  # how often replicas report their load to routers
STORE_WEIGHT = 0.5  # a prompt token in the prefix store, against one in the replica's own pool (1) or nowhere (0)
STORE = "prefix store"  # the index's owner name for blocks the prefix store holds


def block_keys(request: GenerationRequest) -> list[bytes]:
    """Chained keys of the request's full ``AFFINITY_BLOCK``-token blocks (its adapter's digest
    first: KV made with another adapter is another prefix)."""
    tokens = request.context_token_ids
    keys, parent = [], request.lora.digest if request.lora is not None else b""
    for start in range(0, len(tokens) - AFFINITY_BLOCK + 1, AFFINITY_BLOCK):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(np.asarray(tokens[start:start + AFFINITY_BLOCK], dtype=np.int64).tobytes())
        keys.append(parent := digest.digest())
    return keys


class PrefixIndex:
    """Which replicas were sent which prompt blocks."""

    def __init__(self, capacity: int = INDEX_ENTRIES) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[bytes, set[str]] = OrderedDict()

    def matched_tokens(self, keys: list[bytes], replicas: list[str]) -> dict[str, int]:
        """Per replica, the tokens of the leading blocks it was sent."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for key in keys:
            alive &= self._owners.get(key, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] += AFFINITY_BLOCK
        return matched

    def owners(self, key: bytes) -> set[str]:
        """The replicas that were sent the block ``key``."""
        return set(self._owners.get(key, ()))

    def insert(self, keys: list[bytes], replica: str) -> None:
        for key in keys:
            self._owners.setdefault(key, set()).add(replica)
            self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)


_indexes: dict[str, PrefixIndex] = {}  # deployment name -> its index (this process)
_replica_counts: dict[str, int] = {}  # deployment name -> replicas it had at its last routing (this process)
_sent: dict[str, list[tuple[float, float]]] = {}  # replica id -> (time.monotonic(), load) sent since its last report
_first_choices: dict[str, str] = {}  # P call's request id -> the replica ranked first for it, until answered
FIRST_CHOICES_KEPT = 4096  # bounds _first_choices should a call end before it was routed
_routed: dict[str, set[str]] = {}  # deployment name -> its running replicas, as Serve last told this process's router
_paired: dict[str, set[str] | None] = {}  # deployment name -> the only replicas calls may go to (None: any)
_stored: set[str] = set()  # deployments whose replicas publish to and pull from the app's prefix store
_by_load_alone: set[str] = set()  # deployments routed without prefix affinity (AppArgs pd_prefill_affinity off)


def routed_replicas(deployment: str) -> set[str] | None:
    """The replica ids Serve last gave this process's router of ``deployment`` (None before it did):
    a replica joins once running; one that died leaves only when Serve's controller has noticed."""
    return _routed.get(deployment)


def set_paired(deployment: str, replicas: set[str] | None) -> None:
    """The replicas of ``deployment`` whose KV means what their pairs' does (the ingress's DecodeWatch
    pairs them, deployments/pd/compatibility.py): calls go to them alone, but those pinned elsewhere
    (the watch's probes); a replica not described yet takes none. None: no pairing, any replica."""
    _paired[deployment] = replicas


def set_prefix_store(deployment: str) -> None:
    """``deployment``'s replicas share the app's prefix store: routing counts what it holds (module docstring)."""
    _stored.add(deployment)


def set_affinity_off(deployment: str) -> None:
    """``deployment``'s calls go by load alone, ties at random: no replica is preferred for a prompt it was sent."""
    _by_load_alone.add(deployment)


def first_choice(request_id: str) -> str | None:
    """The P replica this process ranked first for ``request_id``'s call, forgotten once asked: the
    ingress marks it stalled when the call is not taken (deployments/replicas/liveness.py)."""
    return _first_choices.pop(request_id, None)


def sent_anywhere(deployment: str, request: GenerationRequest) -> bool:
    """Whether this process's index has a running replica of ``deployment`` sent the first block
    of ``request``'s prompt: if not, none holds any of it, as far as this ingress knows (the PD
    policy's ``no_prefix_anywhere``)."""
    index, keys = _indexes.get(deployment), block_keys(request)
    if index is None or not keys:
        return False
    owners, running = index.owners(keys[0]), routed_replicas(deployment)
    return bool(owners if running is None else owners & running)


def replica_count(deployment: str) -> int:
    """The replicas ``deployment`` had when this process last routed a call to it (1 before that)."""
    return _replica_counts.get(deployment, 1)


def load(replica: RunningReplica, prefill: bool, now: float) -> float:
    """The replica's load: its last report and what this process sent it since; P's in prompt
    tokens to compute, the others' in requests."""
    stats = replica.routing_stats or {}
    reported = stats.get("queued_prompt_tokens", 0) if prefill else stats.get("requests", 0)
    rid = replica.replica_id.to_full_id_str()
    recent = [(t, n) for t, n in _sent.get(rid, []) if now - t < 2 * STATS_PERIOD_S]
    _sent[rid] = recent
    return reported + sum(n for _, n in recent)


def rank(deployment: str, request: GenerationRequest, replicas: list[RunningReplica], prefill: bool
         ) -> list[RunningReplica]:
    """``replicas`` best first for ``request``: by the prompt tokens each was sent, then by load,
    unless their loads differ by more than the imbalance bound (then by load first). Records the
    first as sent the request's prefix and its load. ``prefill``: the call is P's."""
    index = _indexes.setdefault(deployment, PrefixIndex())
    keys = block_keys(request)
    ids = [r.replica_id.to_full_id_str() for r in replicas]
    matched = dict.fromkeys(ids, 0) if deployment in _by_load_alone else index.matched_tokens(keys, ids)
    stored = index.matched_tokens(keys, [STORE])[STORE] if deployment in _stored else 0
    worth = {rid: matched[rid] + STORE_WEIGHT * max(0, stored - matched[rid]) for rid in ids}
    now = time.monotonic()
    loads = {rid: load(r, prefill, now) for rid, r in zip(ids, replicas)}
    bound = PREFILL_IMBALANCE_TOKENS if prefill else IMBALANCE_REQUESTS
    balanced = max(loads.values()) - min(loads.values()) <= bound
    ties = {rid: random.random() for rid in ids}
    order = sorted(range(len(replicas)), key=lambda i: (
        (-worth[ids[i]], loads[ids[i]]) if balanced else (loads[ids[i]], -worth[ids[i]]), ties[ids[i]]))
    best = ids[order[0]]
    index.insert(keys, best)
    if deployment in _stored:
        index.insert(keys, STORE)
    if prefill:
        _first_choices[request.request_id] = best
        while len(_first_choices) > FIRST_CHOICES_KEPT:
            del _first_choices[next(iter(_first_choices))]
    to_compute = request.num_context_tokens - max(matched[best], stored)  # P: what neither its pool nor the store has
    _sent.setdefault(best, []).append((now, to_compute if prefill else 1))
    return [replicas[i] for i in order]


class EngineRouter(FIFOMixin, RequestRouter):
    """Pinned calls to their replica; the rest by prefix affinity and load (module docstring)."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        from deployments.pd import routing  # the imported module's globals, as in choose_replicas

        routing._routed[self._deployment_id.name] = {r.replica_id.to_full_id_str() for r in replicas}
        super().update_replicas(replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # Serve may rebuild this class from a pickle, its methods with a copy of this module's
        # globals: read the index and the marks from the imported modules, the ones the ingress writes.
        from deployments.replicas import liveness
        from deployments.pd import routing

        if pending_request is not None:
            # Serve retries a choice that found no replica (or only full ones) at once and without
            # yielding unless told to back off (its locality mixin tells it so; this router has none):
            # a request no replica may take (every D unpaired) would spin the router's event loop, which
            # every handle of this process shares, and no call of any deployment would be routed again.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        routing._replica_counts[self._deployment_id.name] = len(candidate_replicas)
        pinned = pending_request.kwargs.get("pinned") if pending_request is not None else None
        if pinned:
            chosen = [r for r in candidate_replicas if r.replica_id.to_full_id_str() == pinned]
            if chosen:
                return [chosen]
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(request, GenerationRequest):  # info, stats: any replica answers them
            live = liveness.preferred(candidate_replicas)
            return [random.sample(live, min(2, len(live)))]
        allowed = routing._paired.get(self._deployment_id.name)
        paired = [r for r in candidate_replicas if allowed is None or r.replica_id.to_full_id_str() in allowed]
        if not paired:  # none may take it yet: Serve asks again as the pairing changes (D down sends work to P)
            return []
        live = liveness.preferred(paired)
        prefill = pending_request.metadata.call_method == "prefill"
        ranked = routing.rank(self._deployment_id.name, request, live, prefill)
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
