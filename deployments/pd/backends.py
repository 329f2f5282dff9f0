"""How the ingress reaches the engines: colocated (one deployment) or disaggregated (P then D).

Both yield batches of the engine's RequestOutputs (one per step per choice, in order, as the
engine made them), so the request flow above (deployments/ingress/request_flow.py) sees what it
saw. Every engine's outputs come on one channel per replica and ingress, a step's outputs of all
its requests in one item (deployments/replicas/output_channels.py): the colocated engine's, D's
(after P's reply, prefilling locally, or alone) and P's when it serves alone. P's reply, the one
thing the ingress hands on before D, comes on a call of its own per request. When the caller stops
iterating (a client went away), the request is aborted in its replica (the channel told, or P's
call cancelled), which frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import functools
from contextlib import aclosing
from dataclasses import replace
import logging
from typing import AsyncIterator, Awaitable, Callable

from ray.serve.handle import DeploymentHandle

from deployments.pd import routing
from deployments.pd.decode_watch import NO_PREFILL_ANSWER, DecodeWatch
from deployments.pd.disaggregation import NO_DECODE_REPLICA, NO_PLAN, NO_PREFILL_REPLICA, Decision, DisaggregationPolicy
from deployments.failures import DecodeDown, KVLeaseExpired, NoDecodeReplica, NoPrefillReplica, ReplicaGone
from deployments.ingress.migration import moved_leg
from deployments.pd.kv_connector import KVConnector, ObjectStoreConnector, PrefillReply
from deployments.replicas.liveness import Accepted, taken_then_watched
from deployments.replicas.output_channels import ChannelReceiver, detached
from deployments.ingress.streams import cancel_all
from deployments.ingress.tracing import KVTransfer, RequestTrace
from engine.outputs import RequestOutput
from engine.request import GenerationRequest
from engine.running_export import Moved, MovedChoice

logger = logging.getLogger("ray.serve." + __name__)
MAX_MOVES = 4  # moves of one request (a D drained while a moved request reaches it): past them, token replay


class ColocatedBackend:
    """One engine deployment serving each request whole. Each request is submitted to a replica
    (routed as deployments/pd/routing.py says) and its outputs come back on that replica's channel
    to this ingress, which carries every request's outputs of a step in one item
    (deployments/replicas/output_channels.py). Requests and outputs are plain data: they go by value over
    Ray Serve's replica-to-replica gRPC channel, not as Ray actor tasks (docs/serving.md)."""

    def __init__(self, llm: DeploymentHandle, stall_timeout_s: float) -> None:
        self.handles = {"LLMServer": llm}
        self.channels = ChannelReceiver(llm, stall_timeout_s)

    def stream(self, request: GenerationRequest, trace: RequestTrace | None = None
               ) -> AsyncIterator[list[RequestOutput]]:
        """The engine's output batches; a replica failure if its replica stops or dies mid-stream.
        The one replica may be restarting: no bound on its taking the request but the deadline."""
        return _traced(self.channels.stream(request), trace)


class PDBackend:
    """The ingress orchestrates P and D for each request (docs/serving.md, "Prefix-aware PD"):

    1. unless the prompt is short, or no D replica was sent any of it (the router's index), a D
       replica (routed by prefix affinity and load, deployments/pd/routing.py) says how much of the
       prompt its prefix cache holds, and keeps it for the request (``plan``);
    2. the policy (deployments/pd/disaggregation.py) decides where the rest is computed;
    3. local: D runs the whole request (``generate``), pinned to the replica that answered;
    4. remote: P runs the prompt and returns each choice's first token at once, with the KV of
       the tokens D lacks; the ingress hands the first tokens to the client, then calls D,
       pinned, with P's reply. The KV goes from P to D through the KV connector
       (deployments/pd/kv_connector.py): only its handle passes through here.

    D's outputs, whichever way it serves, come on its channel to this ingress (one per D replica,
    deployments/replicas/output_channels.py): D's call answers once it has taken the request, and the
    request's KV fetch (its record, for the trace) and outputs follow on the channel.

    The ingress owns the KV from P's reply until a D replica takes the request, so it outlives P's
    replica. A D replica must take the request within ``kv_lease_s``; one that does not (stalled,
    or never reached) is no longer waited for, and the request fails with ``KVLeaseExpired``, a
    replica failure: deployments/ingress/migration.py prefills it again (a D that takes it later is
    told to abort it). One that stops once it has taken the request fails every request on its
    channel with ``ReplicaStalled`` after ``stall_timeout_s`` (liveness.py).

    While no D replica can answer (``DecodeWatch``, deployments/pd/decode_watch.py), P serves new
    requests whole, as a colocated engine, and a request waiting for a D to take its KV fails with
    ``DecodeDown`` (a replica failure: it moves to P); with ``degrade_to_prefill`` off, new requests
    fail at once with ``NoDecodeReplica`` (a clean 503) instead. While no P replica answers and a D
    does, D serves new requests whole (its local prefill, unpinned); a request whose P call stalls
    migrates there; with ``degrade_to_decode`` off, ``NoPrefillReplica`` (a clean 503).

    A D replica that Serve drains moves its running requests (deployments/replicas/servers.py): a
    request's D stream ends with a ``Moved`` (each running choice's KV, tokens so far and sampler
    state), and each choice goes on on another D, routed as any decode (the draining one is out of
    Serve's routing), as a resumed request whose KV comes through the KV connector (``_followed``):
    the client's stream goes on unbroken, nothing is computed again. The ``Moved`` carries each
    choice's KV by reference (the connector's ``export`` on D, ``adopt`` here: the ingress owns it
    from then on, as it owns P's). A move whose KV is gone (the draining D's process ended before
    the ingress took it over) or whose new D does not take over (lease, KV fetch) fails as any
    decode does, and migration replays the tokens."""

    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, kv_lease_s: float,
                 stall_timeout_s: float, policy: DisaggregationPolicy, kv: KVConnector | None = None,
                 degrade_to_prefill: bool = True, degrade_to_decode: bool = True) -> None:
        """``kv``: the app's KV connector (``kv_transport``), the one its P and D use."""
        self.prefill, self.decode = prefill, decode
        self.watch = DecodeWatch(decode, stall_timeout_s / 4, stall_timeout_s, prefill)
        self.degrade_to_prefill, self.degrade_to_decode = degrade_to_prefill, degrade_to_decode
        self.kv_lease_s, self.stall_timeout_s = kv_lease_s, stall_timeout_s
        self.policy = policy
        self.kv: KVConnector = kv or ObjectStoreConnector()
        self.handles = {"PrefillServer": prefill, "DecodeServer": decode}
        self.prefill_channels = ChannelReceiver(prefill, stall_timeout_s)  # P alone (no D answers)
        self.decode_channels = ChannelReceiver(decode, stall_timeout_s)
        self._release = decode.options(_by_reference=False).release  # a planned request's prefix hold
        self.prefill_tokens_in_flight = 0  # prompt tokens this ingress has asked P to compute, not answered yet
        self.decisions: Counter[tuple[str, str]] = Counter()  # (where: decode/prefill, reason) -> requests
        self.prompt_tokens: Counter[str] = Counter()  # by who had them: decode_cache, decode, prefill
        self.moves: Counter[str] = Counter()  # choices moved off a draining D, their KV bytes, moves that failed

    async def stream(self, request: GenerationRequest, trace: RequestTrace | None = None, *,
                     disaggregate: bool = False) -> AsyncIterator[list[RequestOutput]]:
        """The request's output batches, from D alone or from P then D; ``trace`` learns each engine's
        times and the KV fetch. ``disaggregate``: through P and D whatever the policy says, and
        not counted (the health canary, which checks both; one alone while the other does not answer)."""
        alone = (self.prefill_only if self.watch.down() else
                 self.decode_only if self.watch.prefill_down() else None)
        if alone is not None:
            async with aclosing(alone(request, trace, counted=not disaggregate)) as batches:
                async for batch in batches:
                    yield batch
            return
        num_tokens = request.num_context_tokens
        plan = None
        per_replica = self.prefill_tokens_in_flight / routing.replica_count("PrefillServer")
        decision = Decision(False, "remote") if disaggregate else self.policy.without_plan(
            num_tokens, per_replica, routing.sent_anywhere("DecodeServer", request))
        if decision is None:
            try:
                plan = await asyncio.wait_for(self.decode.plan.remote(request), self.stall_timeout_s)
            except TimeoutError:  # a stalled D: the KV lease and migration deal with it, as without plans
                decision = Decision(False, NO_PLAN)
        if plan is not None:
            decision = self.policy.decide(num_tokens, plan.cached_tokens, plan.load, per_replica)
        cached = plan.cached_tokens if plan is not None else 0
        pinned = plan.replica if plan is not None else None
        if not disaggregate:
            self.decisions["decode" if decision.local else "prefill", decision.reason] += 1
            self.prompt_tokens["decode_cache"] += cached
            self.prompt_tokens["decode" if decision.local else "prefill"] += num_tokens - cached
        try:
            if decision.local:
                steps = self._whole(self.decode_channels, None, request, trace, pinned)
            else:
                reply = await self.prefill_step(request, cached)
                if trace:
                    for output in reply.outputs:
                        trace.record_prefill(output)
                if reply.outputs:
                    yield list(reply.outputs)
                if reply.handoff is None:
                    return
                steps = self.decode_step(request, reply, trace, pinned)
            async with aclosing(self._followed(request, steps, trace)) as batches:
                async for batch in batches:
                    yield batch
        finally:
            if pinned is not None:  # the planning D holds the prompt's prefix for the request until told
                detached(self._release.remote, request.request_id, pinned=pinned)

    def prefill_only(self, request: GenerationRequest, trace: RequestTrace | None = None,
                     counted: bool = True) -> AsyncIterator[list[RequestOutput]]:
        """No D replica answers: P serves the whole request (its engine decodes too), counted as a
        ``prefill_only`` decision; NoDecodeReplica instead with degradation off."""
        if not self.degrade_to_prefill:
            raise NoDecodeReplica(f"{self.watch.why_down()} and pd_degrade_to_prefill is off")
        return self._whole(self.prefill_channels, ("prefill_only", NO_DECODE_REPLICA) if counted else None,
                           request, trace)

    def decode_only(self, request: GenerationRequest, trace: RequestTrace | None = None,
                    counted: bool = True) -> AsyncIterator[list[RequestOutput]]:
        """No P replica answers: D serves the whole request (its local prefill, on any D), counted as
        a ``decode_only`` decision; NoPrefillReplica instead with degradation off."""
        if not self.degrade_to_decode:
            raise NoPrefillReplica(f"{NO_PREFILL_ANSWER} and pd_degrade_to_decode is off")
        return self._followed(request, self._whole(self.decode_channels, ("decode_only", NO_PREFILL_REPLICA)
                                                   if counted else None, request, trace), trace)

    def _whole(self, channels: ChannelReceiver, decision: tuple[str, str] | None, request: GenerationRequest,
               trace: RequestTrace | None, pinned: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """The output batches of an engine serving the whole request, on its replica's channel
        (``channels``: P's or D's); ``decision`` (where, why) counted unless None; ``pinned``: the
        D replica whose prefix hold the request uses (None: routed)."""
        if decision is not None:
            self.decisions[decision] += 1
        accept = None if pinned is None else functools.partial(channels.submit.remote, request, pinned=pinned)
        return _traced(channels.stream(request, accept), trace)

    async def prefill_step(self, request: GenerationRequest, kv_export_start: int = 0) -> PrefillReply:
        """P's reply, with the handle to its KV (owned here) from token ``kv_export_start`` on,
        when D is to go on. ReplicaStalled if P does not take the call, or stops sending heartbeats,
        for ``stall_timeout_s``: the request is prefilled again elsewhere (deployments/ingress/migration.py)."""
        tokens = request.num_context_tokens - kv_export_start
        self.prefill_tokens_in_flight += tokens
        call = self.prefill.options(stream=True).prefill.remote(request, kv_export_start)
        routed_to = functools.partial(routing.first_choice, request.request_id)
        try:
            return await self.kv.claim(call, lambda items: taken_then_watched(items, self.stall_timeout_s, routed_to))
        except BaseException:  # cancelled, or P stalled: a P that runs again drops the request
            call.cancel()
            raise
        finally:
            self.prefill_tokens_in_flight -= tokens
            routing.first_choice(request.request_id)  # forgotten once answered

    def decode_step(self, request: GenerationRequest, reply: PrefillReply, trace: RequestTrace | None = None,
                    pinned: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """D's output batches after P's ``reply``, on D's channel; KVLeaseExpired if no D takes the
        request within the lease, DecodeDown if every D stops answering first. ``pinned``: the D
        replica that holds the prefix P's KV continues. Taking the request, D holds its own handle
        to the KV: the ingress drops its own."""
        async def taken(accepted: Awaitable[Accepted]) -> Accepted:
            accepted = await _taken(accepted, self.kv_lease_s, self.watch.until_down)
            self.kv.release(reply)
            return accepted

        accept = functools.partial(self.decode.decode.remote, request, reply, pinned=pinned)
        return _traced(self.decode_channels.stream(request, accept, taken), trace, decoded=True)


    async def _followed(self, request: GenerationRequest, batches: AsyncIterator[list], trace: RequestTrace | None,
                        moves: int = 0) -> AsyncIterator[list[RequestOutput]]:
        """D's ``batches`` for ``request``, then, if its D moved it (the last item a ``Moved``), the
        batches of the D replicas that took its choices over, as ``request``'s; ``moves``: its moves so far."""
        moved = None
        async with aclosing(batches):
            async for batch in batches:
                if isinstance(batch[-1], Moved):
                    moved, batch = batch[-1], batch[:-1]
                if batch:
                    yield batch
        if moved is None:
            return
        if moves >= MAX_MOVES:
            raise ReplicaGone(f"request {request.request_id} was moved {moves} times; its tokens are replayed")
        logger.info("request %s: decode replica %s drains; %d choice(s) move to another (%d KV bytes)",
                    request.request_id, moved.replica, len(moved.choices), moved.nbytes)
        streams = [self._moved_choice(request, choice, moves + 1, trace) for choice in moved.choices]
        async with aclosing(_merged(streams)) as batches:
            async for batch in batches:
                yield batch

    async def _moved_choice(self, request: GenerationRequest, choice: MovedChoice, move: int,
                            trace: RequestTrace | None) -> AsyncIterator[list[RequestOutput]]:
        """One moved choice on the D that takes it (``decode_step``: the KV lease, the connector), its
        outputs as ``request``'s choice. Its KV came by reference: the ingress takes it over first,
        at once (the draining D's process may end once its requests have left it)."""
        leg, handoff = moved_leg(request, choice, move)
        self.moves["choices"] += 1
        self.moves["bytes"] += choice.nbytes
        try:
            reply = PrefillReply([], handoff, await self.kv.adopt(choice.kv))
            async with aclosing(self._followed(leg, self.decode_step(leg, reply, trace), trace, move)) as batches:
                async for batch in batches:
                    yield [replace(o, request_id=request.request_id, index=choice.index) for o in batch]
        except Exception:
            self.moves["failed"] += 1
            raise


async def _merged(streams: list[AsyncIterator[list]]) -> AsyncIterator[list]:
    """The batches of ``streams`` as they come, until all end; the first error ends the others."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as batches:
            async for batch in batches:
                yield batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[list]) -> None:
        try:
            async with aclosing(stream) as batches:
                async for batch in batches:
                    queue.put_nowait(batch)
            queue.put_nowait(None)
        except Exception as error:
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        await cancel_all(tasks)


async def _traced(batches: AsyncIterator[list], trace: RequestTrace | None, decoded: bool = False
                  ) -> AsyncIterator[list[RequestOutput]]:
    """A channel's output batches for one request; ``trace`` learns the engine's times (of a
    request that D decodes after P, ``decoded``, else of one that an engine prefilled) and D's
    KV fetch, a KVTransfer that comes before any output and goes no further."""
    async with aclosing(batches):
        async for batch in batches:
            if isinstance(batch[0], KVTransfer):
                if trace:
                    trace.record_kv(batch[0])
                del batch[0]
                if not batch:
                    continue
            if trace:
                record = trace.record_decode if decoded else trace.record_prefill
                for output in batch:
                    if not isinstance(output, Moved):  # the request goes on elsewhere (PDBackend._followed)
                        record(output)
            yield batch


async def _taken(accepted: Awaitable, lease_s: float, until_down: Callable[[], Awaitable[None]]) -> Accepted:
    """``accepted``'s result; KVLeaseExpired past ``lease_s``, DecodeDown if ``until_down()`` returns
    first. The losers are cancelled."""
    taken = asyncio.ensure_future(accepted)
    down = asyncio.ensure_future(until_down())
    waiting = {taken, down}
    try:
        done, _ = await asyncio.wait(waiting, timeout=lease_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_all(waiting)
    if taken in done:
        return taken.result()
    if down in done:
        raise DecodeDown("no decode replica answers: the request moves before its KV lease ends")
    raise KVLeaseExpired(f"no decode replica took the request within the {lease_s:g} s lease of its KV")
