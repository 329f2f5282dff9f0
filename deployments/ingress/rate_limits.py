"""Per-key rate limits: requests and tokens per minute, counted across the ingress replicas.

The app's ``rate_limits`` names its keys and their limits; a request is its key's when it carries
it (``Authorization: Bearer <key>``, or ``x-api-key`` on Anthropic's routes), and the ``default``
budget's otherwise (no key, or one not listed). Listed keys are also valid API keys when
``api_key`` is set. A batch's lines count against the key that created it.

What counts, over the last 60 seconds (a sliding window):
- requests: each request to a generation or embeddings route, and Databricks' invocations (which
  the app's binding tells ``refusal``: dialects/http_edge.py ``rate_limited``);
- tokens: each engine request's prompt tokens when it starts and its generated tokens when it ends
  (embeddings count as requests only).
A request is refused (``RateLimited``: a 429, Retry-After when the window will have room) when its
key has made ``rpm`` requests in the window, or used ``tpm`` tokens; tokens are counted as they are used, so a
request admitted under the budget may end above it, and the next waits.

The counts live in one named, detached Ray actor per application (``RateCounter``,
"pdserve-rate-limits:<app>"), which every ingress replica calls: one call per limited request, none
for a key without limits. Detached, so that it outlives the ingress replica that made it (a
replica's own actors die with it, and a restarted ingress would find the name of a dead actor); it
stays when the application is deleted (a few kilobytes) and is found again when it is deployed
again. Each ingress starts it when it starts, so a request does not wait for a worker to start. If it
is lost all the same, the next call makes a new one: the window starts empty.
"""

from __future__ import annotations

import asyncio
from collections import deque
import hmac
import math
import time
from typing import Callable, Mapping

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, SecretStr
import ray

from deployments.failures import RateCounterDown, RateLimited

WINDOW_S = 60.0
DEFAULT_KEY = "default"
COUNTER_CALL_TIMEOUT_S = 30.0  # a clean 503 past it; a loaded machine's actor call can take seconds


class KeyLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(None, gt=0, description="requests per minute; unset: unlimited")
    tpm: int | None = Field(None, gt=0, description="tokens (prompt + generated) per minute; unset: unlimited")

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None


class NamedKey(KeyLimits):
    key: SecretStr = Field(description="the API key, as clients send it")


class RateLimits(BaseModel):
    """AppArgs.rate_limits: ``{"default": {"rpm": 600}, "keys": {"team-a": {"key": "sk-a", "tpm": 100000}}}``."""

    model_config = ConfigDict(extra="forbid")

    default: KeyLimits = Field(default_factory=KeyLimits, description="requests with no key or an unlisted one")
    keys: dict[str, NamedKey] = Field(default_factory=dict, description="name -> its key and limits; the name "
                                      "labels /metrics (the key itself is never shown)")

    def key_name(self, headers: Mapping[str, str]) -> str:
        """The name of the listed key the request carries, else ``DEFAULT_KEY``."""
        scheme, _, given = (headers.get("authorization") or "").partition(" ")
        candidates = [c for c in ((given.strip() if scheme.lower() == "bearer" else None), headers.get("x-api-key"))
                      if c]
        for name, named in self.keys.items():
            secret = named.key.get_secret_value().encode()
            if any(hmac.compare_digest(c.encode(), secret) for c in candidates):
                return name
        return DEFAULT_KEY

    def of(self, name: str) -> KeyLimits:
        return self.keys.get(name, self.default)

    def api_keys(self) -> list[str]:
        return [named.key.get_secret_value() for named in self.keys.values()]


class SlidingWindow:
    """The requests and tokens of each key in the last WINDOW_S seconds (``RateCounter`` holds one
    for every ingress replica of an app)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.requests: dict[str, deque[float]] = {}
        self.tokens: dict[str, deque[tuple[float, int]]] = {}

    def _window(self, key: str, now: float) -> tuple[deque[float], deque[tuple[float, int]]]:
        requests, tokens = self.requests.setdefault(key, deque()), self.tokens.setdefault(key, deque())
        while requests and requests[0] <= now - WINDOW_S:
            requests.popleft()
        while tokens and tokens[0][0] <= now - WINDOW_S:
            tokens.popleft()
        return requests, tokens

    def admit(self, key: str, rpm: int | None, tpm: int | None) -> tuple[float, str | None, int, int]:
        """(0, None, ...) and the request counted, or (seconds until there is room, the limit hit, ...);
        then the key's requests and tokens in the window."""
        now = self.clock()
        requests, tokens = self._window(key, now)
        used = sum(n for _, n in tokens)
        if rpm is not None and len(requests) >= rpm:
            return requests[0] + WINDOW_S - now, "rpm", len(requests), used
        if tpm is not None and used >= tpm:
            freed, wait = used, 0.0
            for at, n in tokens:  # the oldest leave the window first
                freed -= n
                wait = at + WINDOW_S - now
                if freed < tpm:
                    break
            return wait, "tpm", len(requests), used
        requests.append(now)
        return 0.0, None, len(requests), used

    def charge(self, key: str, tokens: int) -> None:
        if tokens:
            now = self.clock()
            self._window(key, now)[1].append((now, tokens))


RateCounter = ray.remote(num_cpus=0)(SlidingWindow)


class RateLimiter:
    """One ingress replica's side: which key a request is, the check at its arrival, its tokens."""

    def __init__(self, limits: RateLimits, app_name: str, registry: CollectorRegistry) -> None:
        self.limits = limits
        self.actor_name = f"pdserve-rate-limits:{app_name}"
        self._counter = None
        self.refused = Counter("pdserve_rate_limited_requests", "requests refused with 429 by a key's limit",
                               ["key", "limit"], registry=registry)
        self.window = Gauge("pdserve_rate_limit_window", "a key's requests / tokens in the last minute, as of its "
                            "last request here", ["key", "kind"], registry=registry)
        configured = Gauge("pdserve_rate_limit", "a key's configured limit per minute", ["key", "kind"],
                           registry=registry)
        for name, key_limits in [(DEFAULT_KEY, limits.default), *limits.keys.items()]:
            for kind in ("rpm", "tpm"):
                if getattr(key_limits, kind) is not None:
                    configured.labels(name, kind).set(getattr(key_limits, kind))
        if limits.default.limited or any(key.limited for key in limits.keys.values()):
            self.counter()  # started now: its worker is up before the first limited request

    def counter(self):
        if self._counter is None:
            self._counter = RateCounter.options(name=self.actor_name, namespace="serve", get_if_exists=True,
                                                lifetime="detached").remote()
        return self._counter

    async def _call(self, method: str, *args):
        """A call of the shared counter; once more on a new one if it was lost."""
        for attempt in range(2):
            try:
                return await asyncio.wait_for(getattr(self.counter(), method).remote(*args), COUNTER_CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, TimeoutError):
                self._counter = None
                if attempt:
                    raise RateCounterDown("the rate-limit counter does not answer; retry") from None

    async def refusal(self, request: Request, limited: bool) -> RateLimited | None:
        """The request's refusal, or None (its key, ``request.state.rate_key``, set for the routes
        after: a batch line's own is set by the runner, every other from the request's headers).
        ``limited``: whether its route counts against the key's limits."""
        key = getattr(request.state, "rate_key", None) or self.limits.key_name(request.headers)
        request.state.rate_key = key
        return await self.check(key, limited)

    async def check(self, key: str, limited: bool) -> RateLimited | None:
        """``RateLimited`` (a 429 with its Retry-After) when ``key`` has no room for one more request
        on a ``limited`` route."""
        key_limits = self.limits.of(key)
        if not limited or not key_limits.limited:
            return None
        wait, limit, requests, tokens = await self._call("admit", key, key_limits.rpm, key_limits.tpm)
        self.window.labels(key, "requests").set(requests)
        self.window.labels(key, "tokens").set(tokens)
        if limit is None:
            return None
        self.refused.labels(key, limit).inc()
        unit = "requests" if limit == "rpm" else "tokens"
        return RateLimited(f"rate limit reached for key {key!r}: {getattr(key_limits, limit)} {unit} per minute "
                           f"({limit}); retry after {math.ceil(wait)} s", retry_after=max(1, math.ceil(wait)))

    def charge(self, key: str, tokens: int) -> None:
        """Count ``tokens`` against ``key`` (a request's prompt at its start, its generated tokens at
        its end: deployments/ingress/request_flow.py); nothing for a key without a token limit."""
        if tokens and self.limits.of(key).tpm:
            self.counter().charge.remote(key, tokens)
