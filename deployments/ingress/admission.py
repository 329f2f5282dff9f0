"""Admission control: how much work the ingress hands the engines before it refuses more.

Each role (P, D or the colocated engine) has a budget: the tokens of the requests this ingress has
in flight to it, ``tokens_per_replica`` times its replicas, and their count, ``requests_per_replica``
(Serve's ``max_ongoing_requests``) times its replicas. A request costs its prompt plus the tokens it
may generate (``max_new_tokens`` for each choice or beam): to D (or colocated) from its start to its
end, to P its prompt until its first token is out. A request that does not fit is refused at once
(``Overloaded``; the ingress answers 503 with ``Retry-After``), never queued here: the engines' own
queues, ordered by priority, are the queue, and this bounds them, so under a burst a client gets
a prompt answer, never a wait that ends in a timeout. A role with nothing in flight at a request's
priority or higher admits it, so that one larger than the budget is still served.

Priority is an order of service here too: a request of priority p is measured against the work of
its own and higher priorities only (priority <= p), which may fill ``SHARE[p]`` of a budget. Work of
lower priority never makes the ingress refuse it: the engines serve it first and preempt that work
for its KV (engine/scheduler.py). So priority 5 alone fills at most 60 % of a budget, priority 1
is refused only when priority-1 work fills all of it, and in flight there is at most
``IN_FLIGHT_FACTOR`` times a budget (every level full), which the engines' Serve
``max_ongoing_requests`` is sized for (``serve_max_ongoing``) so that Serve's router never queues
a call (docs/serving.md, "Overload").
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Callable

from engine.request import PRIORITY_MAX, PRIORITY_MIN, GenerationRequest

SHARE = {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6}  # by priority p: the fraction of a budget work of priority <= p may fill
IN_FLIGHT_FACTOR = sum(SHARE.values())  # the most in flight, in budgets: every level filled in turn, lowest first
RETRY_AFTER_S = 1  # a refused client's Retry-After: in-flight requests end within a few of it


def serve_max_ongoing(requests_per_replica: int) -> int:
    """An engine deployment's Serve ``max_ongoing_requests`` for a request budget of ``requests_per_replica``:
    the most admission lets in flight to one replica, so that Serve's router never queues a call."""
    return math.ceil(IN_FLIGHT_FACTOR * requests_per_replica)


class Overloaded(Exception):
    """A request that does not fit its role's budget; ``retry_after`` in seconds."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class RoleLoad:
    """What this ingress has in flight to one engine deployment, by priority (index 1..5; 0 unused)."""

    tokens_by_priority: list[int] = field(default_factory=lambda: [0] * (PRIORITY_MAX + 1))
    requests_by_priority: list[int] = field(default_factory=lambda: [0] * (PRIORITY_MAX + 1))

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_priority)

    @property
    def requests(self) -> int:
        return sum(self.requests_by_priority)

    def ahead_of(self, priority: int) -> tuple[int, int]:
        """(tokens, requests) in flight at ``priority`` or higher: the work served before or beside it."""
        levels = slice(PRIORITY_MIN, priority + 1)
        return sum(self.tokens_by_priority[levels]), sum(self.requests_by_priority[levels])


@dataclass
class Charge:
    role: str
    tokens: int
    priority: int
    released: bool = False


class Ticket:
    """An admitted request's charges; each is released once (``prefilled``: P's; ``done``: all)."""

    def __init__(self, admission: "Admission", charges: list[Charge]) -> None:
        self._admission, self._charges = admission, charges

    def prefilled(self) -> None:
        """The first token is out: P is done with the request."""
        for charge in self._charges[:-1]:
            self._admission.release(charge)

    def done(self) -> None:
        for charge in self._charges:
            self._admission.release(charge)


class Admission:
    """The budgets of one ingress's roles. ``replicas(deployment)``: its replicas now (the router's count).
    ``prefill_role``: P's deployment in PD, None colocated; ``decode_role``: D's or the colocated engine's."""

    def __init__(self, prefill_role: str | None, decode_role: str, tokens_per_replica: int,
                 requests_per_replica: int, replicas: Callable[[str], int]) -> None:
        self.prefill_role, self.decode_role = prefill_role, decode_role
        self.tokens_per_replica, self.requests_per_replica = tokens_per_replica, requests_per_replica
        self.replicas = replicas
        self.load = {role: RoleLoad() for role in (prefill_role, decode_role) if role is not None}

    def admit(self, request: GenerationRequest) -> Ticket:
        """The request's ticket, its tokens counted in flight; Overloaded if a role has no room for it."""
        prompt = request.num_context_tokens
        total = prompt + max(request.n, request.params.beam_width) * request.params.max_new_tokens
        priority = request.priority
        charges = ([Charge(self.prefill_role, prompt, priority)] if self.prefill_role else []) \
            + [Charge(self.decode_role, total, priority)]
        share = SHARE[priority]
        for charge in charges:
            tokens, requests = self.load[charge.role].ahead_of(priority)
            replicas = max(self.replicas(charge.role), 1)
            tokens_bound, requests_bound = self.tokens_per_replica * replicas, self.requests_per_replica * replicas
            if requests and (tokens + charge.tokens > share * tokens_bound or requests + 1 > share * requests_bound):
                raise Overloaded(f"the server is at capacity ({charge.role}: {requests} requests, {tokens} tokens "
                                 f"of priority 1..{priority} in flight; they may use {share:.0%} of "
                                 f"{tokens_bound} tokens); retry after {RETRY_AFTER_S} s")
        for charge in charges:
            self.load[charge.role].tokens_by_priority[priority] += charge.tokens
            self.load[charge.role].requests_by_priority[priority] += 1
        return Ticket(self, charges)

    def release(self, charge: Charge) -> None:
        if not charge.released:
            charge.released = True
            self.load[charge.role].tokens_by_priority[charge.priority] -= charge.tokens
            self.load[charge.role].requests_by_priority[charge.priority] -= 1

