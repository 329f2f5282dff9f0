"""Admission control: how much work the ingress hands the engines before it refuses more.

Each role (P, D or the colocated engine) has a budget: the tokens of the requests this ingress has
in flight to it, ``tokens_per_replica`` times its replicas, and their count, ``requests_per_replica``
(Serve's ``max_ongoing_requests``) times its replicas. A request costs its prompt plus the tokens it
may generate (``max_new_tokens`` for each choice or beam): to D (or colocated) from its start to its
end, to P its prompt until its first token is out. A request that does not fit is refused at once
(``Overloaded``; the ingress answers 503 with ``Retry-After``), never queued here: the engines' own
queues, ordered by priority, are the queue, and this bounds them, so under a burst a client gets
a prompt answer, never a wait that ends in a timeout. A role with nothing in flight admits any
request, so that one larger than the budget is still served.

Priority keeps headroom: a request of priority p may fill a budget up to ``SHARE[p]`` of it, so
near the bound priority 1 is still admitted where priority 5 is refused (docs/serving.md, "Overload").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.outputs import RequestOutput
from engine.request import GenerationRequest

SHARE = {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6}  # by priority: the fraction of a budget it may fill
RETRY_AFTER_S = 1  # a refused client's Retry-After: in-flight requests end within a few of it


class Overloaded(Exception):
    """A request that does not fit its role's budget; ``retry_after`` in seconds."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class RoleLoad:
    """What this ingress has in flight to one engine deployment."""

    tokens: int = 0
    requests: int = 0


@dataclass
class Charge:
    role: str
    tokens: int
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
        charges = ([Charge(self.prefill_role, prompt)] if self.prefill_role else []) + [Charge(self.decode_role, total)]
        share = SHARE[request.priority]
        for charge in charges:
            load, replicas = self.load[charge.role], max(self.replicas(charge.role), 1)
            tokens_bound, requests_bound = self.tokens_per_replica * replicas, self.requests_per_replica * replicas
            if load.requests and (load.tokens + charge.tokens > share * tokens_bound
                                  or load.requests + 1 > share * requests_bound):
                raise Overloaded(f"the server is at capacity ({charge.role}: {load.requests} requests, "
                                 f"{load.tokens} tokens in flight; priority {request.priority} may use "
                                 f"{share:.0%} of {tokens_bound} tokens); retry after {RETRY_AFTER_S} s")
        for charge in charges:
            self.load[charge.role].tokens += charge.tokens
            self.load[charge.role].requests += 1
        return Ticket(self, charges)

    def release(self, charge: Charge) -> None:
        if not charge.released:
            charge.released = True
            self.load[charge.role].tokens -= charge.tokens
            self.load[charge.role].requests -= 1


async def admitted(stream: AsyncIterator[RequestOutput], ticket: Ticket) -> AsyncIterator[RequestOutput]:
    """``stream``, releasing P's charge at its first output and every charge when it ends, however."""
    try:
        async for output in stream:
            ticket.prefilled()
            yield output
    finally:
        ticket.done()
        await stream.aclose()
