"""The engine deployments: P, D, and both in one (colocated).

Each replica owns one AsyncEngine. ``max_ongoing_requests`` is set high (AppArgs) so that
the engine's own priority scheduler, not Ray Serve's FIFO routing, orders the requests.
Each reports its load (``load``) to the request routers (deployments/pd/routing.py) and to the
autoscaler (deployments/replicas/autoscaling.py): P its queued prompt tokens, D and colocated their
requests and KV usage.

A request's outputs leave a replica on the ingress's channel (deployments/replicas/output_channels.py):
``submit`` (a whole request: colocated, D's local prefill, P or D alone) or D's ``decode`` (after P's
reply) starts it and answers ``Accepted``; ``channel`` carries every request's outputs to that
ingress; ``abort`` ends one. P's ``prefill`` alone streams per request: its reply and the KV's handle.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
import logging
import os
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.pd import compatibility
from deployments.pd.compatibility import KVDescriptor
from deployments.pd.disaggregation import DecodeLoad
from deployments.pd.kv_connector import KVConnector, ObjectStoreConnector, PrefillReply
from deployments.failures import PrefixLost, ReplicaGone
from deployments.ingress.tracing import KVTransfer
from deployments.replicas.draining import serve_draining
from deployments.replicas.liveness import Accepted, Heartbeat, heartbeats, replica_id
from deployments.replicas.load_meter import LoadMeter
from deployments.replicas.output_channels import ChannelSender
from deployments.replicas.prefix_store import PrefixStoreClient
from deployments.replicas.lora_store import LoraCache
from deployments.pd.routing import STATS_PERIOD_S, EngineRouter
from engine.async_engine import AsyncEngine, EngineStats
from engine.config import EngineConfig
from engine.model_info import ModelInfo
from engine.outputs import KVWanted, RequestOutput
from engine.request import GenerationRequest
from engine.running_export import Moved

logger = logging.getLogger("ray.serve." + __name__)
DRAIN_POLL_S = 0.1  # how often a D replica looks whether Serve drains it, and then moves what can move
ROUTER = RequestRouterConfig(request_router_class=EngineRouter, request_routing_stats_period_s=STATS_PERIOD_S)


class _EngineServer:
    def __init__(self, engine_config: EngineConfig, lora_store, max_loras: int) -> None:
        """``lora_store``: the app's LoraStore, where this replica fetches adapters it lacks."""
        self.engine = AsyncEngine(engine_config)
        self.loras = LoraCache(lora_store, max_loras)
        self.meter = LoadMeter()  # tokens sent, prompts asked for, time per token (deployments/replicas/load_meter.py)

    def info(self) -> ModelInfo:
        inner = self.engine.engine
        return ModelInfo(str(inner.loaded.path), inner.loaded.model_id, inner.vocab_size, inner.max_model_len,
                         inner.config.max_iter_times, ray.get_runtime_context().get_node_id(), inner.dtype,
                         inner.config.enable_prefix_caching, inner.pad_token_id, inner.loaded.spec.hidden_size,
                         inner.runner.attention.name, inner.runner.batch_invariant, inner.runner.sampler.backend_name,
                         inner.loaded.weight_storage)

    def stats(self):
        return self.engine.stats()

    def replica_stats(self, pinned: str | None = None) -> tuple[str, EngineStats]:
        """This replica's id and engine stats: the ingress's /metrics asks each replica, ``pinned``
        to it (deployments/ingress/metrics.py), and sums them per deployment."""
        return replica_id(), self.engine.stats()

    def holdings(self) -> dict[str, int]:
        """What this replica holds for requests: KV blocks, prefix holds, requests in the engine
        (as of its last step, which is its state once idle) and callers' streams open now. The
        tests' leak checks read it from every replica, one by one (tests/serving.py)."""
        stats = self.engine.stats()
        return {"blocks_used": stats.blocks_used, "prefix_holds": stats.prefix_holds,
                "requests": stats.requests, "streams": self.engine.num_streams()}

    def load(self) -> dict[str, float]:
        """This replica's load, for its router and its autoscaling policy: requests (running and
        waiting) and the fraction of KV blocks held."""
        stats = self.engine.stats()
        return {"requests": stats.running + sum(stats.waiting_by_priority.values()), "kv_usage": stats.kv_cache_usage}

    def record_routing_stats(self) -> dict[str, float]:
        return self.load()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """``load``, the rates since the last call and the recent time per token (LoadMeter): the
        rate-matched policies' inputs (deployments/replicas/autoscaling.py)."""
        return {**self.load(), **self.meter.rates(self.engine.stats().prompt_tokens_computed),
                "token_ms": self.meter.token_ms()}

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop has died."""
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop is not running")

    def hang_next_step(self, seconds: float) -> None:
        """The tests' fault hook: the engine's next step hangs ``seconds`` (AsyncEngine.hang_next_step).
        Refused unless the replica's environment has PDSERVE_FAULT_HOOKS=1; no HTTP route calls it."""
        _fault_hooks_on()
        self.engine.hang_next_step(seconds)

    def __del__(self) -> None:
        self.engine.shutdown()


class _StreamingServer(_EngineServer):
    """A server whose calls can take long: it says so when it takes a call, and that it is alive
    while it has nothing to send, for as long as its engine thread runs and no step has run past
    ``step_timeout_s`` (the step watchdog: a thread stuck inside one step is alive but serves nothing)."""

    def __init__(self, engine_config: EngineConfig, lora_store, max_loras: int, heartbeat_s: float,
                 step_timeout_s: float) -> None:
        super().__init__(engine_config, lora_store, max_loras)
        self.heartbeat_s, self.step_timeout_s = heartbeat_s, step_timeout_s
        self.channels = ChannelSender(self.engine.close_stream)  # deployments/replicas/output_channels.py

    def responsive(self) -> bool:
        """The engine thread runs and the step it is in (if any) has not run past the bound."""
        return self.engine.is_alive() and self.engine.step_running_s() <= self.step_timeout_s

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine loop has died or is stuck inside one step."""
        super().check_health()
        if (running_s := self.engine.step_running_s()) > self.step_timeout_s:
            raise RuntimeError(f"an engine step has run {running_s:.0f} s, past step_timeout_s "
                               f"({self.step_timeout_s:g} s)")

    async def _streamed(self, items: AsyncIterator) -> AsyncIterator:
        """A stream's items after ``Accepted``, with heartbeats while it has nothing to send
        (deployments/replicas/liveness.py)."""
        yield Accepted(replica_id())
        async for item in heartbeats(items, self.heartbeat_s, self.responsive):
            yield item

    async def submit(self, request: GenerationRequest, channel: str, pinned: str | None = None) -> Accepted:
        """Start the whole request in this engine, its outputs going to the ingress's ``channel``
        (deployments/replicas/output_channels.py): colocated, P or D alone, or D prefilling locally
        (``pinned`` to the D replica whose prefix hold it uses, deployments/pd/routing.py).
        ``Accepted`` once it is queued, its error (a bad request) at once. Outputs go in batches,
        every output made since the last item (AsyncEngine.open_batches)."""
        _check_pinned(pinned)
        lora = await self.loras.adapter(request.lora)
        self.channels.start(channel, request.request_id, self._metered(self.engine.open_batches(request, lora)))
        return Accepted(replica_id())

    async def channel(self, channel: str, pinned: str | None = None
                      ) -> AsyncIterator[Accepted | Heartbeat | dict[str, list]]:
        """The ingress's ``channel`` to this replica, ``pinned`` here: ``Accepted``, then every
        step's outputs of its requests in one item (request id -> outputs), heartbeats while there
        is nothing to send; it ends once it has carried no request for a while."""
        if pinned is not None and pinned != replica_id():
            raise ReplicaGone("the replica this channel was opened to is gone")
        yield Accepted(replica_id())
        async for item in self.channels.read(channel, self.heartbeat_s):
            if item is not None:
                yield item
            elif self.responsive():
                yield Heartbeat()

    def abort(self, channel: str, request_id: str, pinned: str | None = None) -> None:
        """The ingress stopped reading ``request_id`` (its client left): end it here. ``pinned``:
        this replica, for the router (deployments/pd/routing.py)."""
        self.channels.abort(channel, request_id)

    def open_channels(self) -> int:
        """The ingresses' channels open on this replica (ChannelSender.open_channels)."""
        return self.channels.open_channels()

    async def _metered(self, batches: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[list[RequestOutput]]:
        previous = None  # when the stream sent its last batch
        async for batch in batches:
            previous = self.meter.sent(batch, previous)
            yield batch


@serve.deployment(ray_actor_options={"num_cpus": 1}, request_router_config=ROUTER)
class LLMServer(_StreamingServer):
    """Prefill and decode in one engine: small deployments, and the baseline for PD."""


@dataclass
class ProbeAnswer:
    """A P or D replica's answer to the ingress's probe (``answering``, deployments/pd/decode_watch.py)."""

    replica: str  # its Serve id
    transfers: dict  # its KV fetches (KVConnector.transfer_health)
    kv: KVDescriptor  # what its KV means (deployments/pd/compatibility.py)


class _KVServer(_StreamingServer):
    """P or D: a server whose KV crosses to the other role, through the app's KV connector."""

    def __init__(self, engine_config: EngineConfig, lora_store, max_loras: int, heartbeat_s: float,
                 step_timeout_s: float, kv: KVConnector | None) -> None:
        """``kv``: the app's KV connector (``kv_transport``), the object store's by default."""
        super().__init__(engine_config, lora_store, max_loras, heartbeat_s, step_timeout_s)
        self.kv = kv or ObjectStoreConnector()
        self.kv_descriptor = compatibility.describe(self.engine.engine, lora_store is not None)  # once, at start

    def answering(self, pinned: str | None = None) -> ProbeAnswer | None:
        """This replica's id, KV fetches and KV descriptor while it can serve (``responsive``), else
        None: the ingress's probe (deployments/pd/decode_watch.py), ``pinned`` to the replica it asks."""
        return ProbeAnswer(replica_id(), self.kv.transfer_health(), self.kv_descriptor) if self.responsive() else None

    def kv_transfers(self) -> dict:
        """Transfers into this replica so far: count, bytes, seconds; in flight now, the oldest's age,
        past their deadline, failed by cause (KVConnector.transfer_health)."""
        return self.kv.transfer_health()


@serve.deployment(ray_actor_options={"num_cpus": 1}, request_router_config=ROUTER)
class PrefillServer(_KVServer):
    def __init__(self, engine_config: EngineConfig, lora_store, max_loras: int, heartbeat_s: float,
                 step_timeout_s: float, kv: KVConnector | None = None, prefix_store=None) -> None:
        """``prefix_store``: the app's PrefixStoreServer (deployments/replicas/prefix_store.py), None when off."""
        super().__init__(engine_config, lora_store, max_loras, heartbeat_s, step_timeout_s, kv)
        self.prefix_store = None if prefix_store is None else PrefixStoreClient(prefix_store, self.engine)

    async def prefill(self, request: GenerationRequest, kv_export_start: int = 0
                      ) -> AsyncIterator[Accepted | Heartbeat | PrefillReply | Any]:
        """``Accepted``, heartbeats while the prompt waits or runs (a stalled P is seen as D is),
        then P's reply and, unless the first token ended every choice, the prompt's KV from token
        ``kv_export_start`` on (D holds the ones before; the connector's items: deployments/pd/kv_connector.py)."""
        async for item in self._streamed(self._prefilled(request, kv_export_start)):
            yield item

    async def _prefilled(self, request: GenerationRequest, kv_export_start: int) -> AsyncIterator:
        self.meter.prompts += 1
        lora = await self.loras.adapter(request.lora)  # under heartbeats: a slow adapter fetch is no stall
        # The app's prefix store: the prompt's blocks it holds beyond this pool are pulled in (under heartbeats)
        keys, stored = await self.prefix_store.pull(request, lora) if self.prefix_store is not None else ([], 0)
        outputs = await self.engine.prefill(request, kv_export_start, lora)
        for item in self.kv.send(outputs):
            yield item
        if self.prefix_store is not None:  # after P's reply: what the store lacks of the exported KV
            result = next((o.prefill for o in outputs if o.prefill is not None), None)
            self.prefix_store.publish(keys, stored, result.kv if result is not None else None)

    async def prefix_store_counters(self) -> dict[str, int] | None:
        """The app's prefix store's counters (PrefixStore.counters), None when it is off: /metrics."""
        return None if self.prefix_store is None else await self.prefix_store.store.counters.remote()

    def load(self) -> dict[str, float]:
        """P's load: the prompt tokens it has yet to compute."""
        return {"queued_prompt_tokens": self.engine.stats().queued_prompt_tokens}


def _check_pinned(pinned: str | None) -> None:
    """A call ``pinned`` to another replica (the D that holds the request's prefix died, and Serve
    routed the call elsewhere) fails as a replica failure."""
    if pinned is not None and pinned != replica_id():
        raise PrefixLost("the decode replica holding this request's prefix is gone")


def _fault_hooks_on() -> None:
    if os.environ.get("PDSERVE_FAULT_HOOKS") != "1":
        raise PermissionError("fault hooks are off (PDSERVE_FAULT_HOOKS=1 turns them on, for tests)")


@dataclass
class DecodePlan:
    """A D replica's answer before P works (``DecodeServer.plan``)."""

    replica: str  # its Serve id: the request's decode or local prefill is pinned to it
    cached_tokens: int  # leading prompt tokens it holds, kept for the request: P's KV starts there
    load: DecodeLoad  # its KV usage, queue, running sequences and time per token


@serve.deployment(ray_actor_options={"num_cpus": 1}, request_router_config=ROUTER)
class DecodeServer(_KVServer):
    def __init__(self, engine_config: EngineConfig, lora_store, max_loras: int, heartbeat_s: float,
                 step_timeout_s: float, hold_s: float, kv: KVConnector | None = None) -> None:
        """``hold_s``: how long a prefix told to the ingress is kept for a request that does not come;
        ``kv``: the app's KV connector, P's transport (the object store's by default)."""
        super().__init__(engine_config, lora_store, max_loras, heartbeat_s, step_timeout_s, kv)
        self.hold_s = hold_s
        self._drain_watch: asyncio.Task | None = None  # started by the first request (``_watch_drain``)

    async def plan(self, request: GenerationRequest) -> DecodePlan:
        """How much of the request's prompt this replica's prefix cache holds, held for the
        request (engine/prefix_holds.py), and its KV usage: the ingress decides from them where
        the prompt is computed (deployments/pd/disaggregation.py)."""
        lora = await self.loras.adapter(request.lora)
        cached = await self.engine.hold_prefix(request, lora, self.hold_s)
        stats = self.engine.stats()
        load = DecodeLoad(stats.kv_cache_usage, sum(stats.waiting_by_priority.values()), stats.running,
                          self.meter.token_ms())
        return DecodePlan(replica_id(), cached, load)

    def release(self, request_id: str, pinned: str | None = None) -> None:
        """The ingress is done with a request this replica planned for (``plan``): drop its prefix
        hold now, not ``hold_s`` later, when the request never came here (it ended on P's first
        token, timed out or lost its client before D was called); an abort, a no-op for a request
        that already ended here. ``pinned``: this replica, for the router."""
        self.engine.abort(request_id)

    async def decode(self, request: GenerationRequest, reply: PrefillReply, channel: str,
                     pinned: str | None = None) -> Accepted:
        """Take the request after P's ``reply`` (``Accepted`` at once: the ingress's KV lease ends
        there), its items going to the ingress's ``channel`` (deployments/replicas/output_channels.py):
        the engine queues it without its KV, the KV is fetched once the engine holds blocks for it
        (``KVWanted``), its KVTransfer goes first (for the request's trace), then the tokens after the
        first. ``pinned``: the replica whose prefix P's KV continues."""
        _check_pinned(pinned)
        self._watch_drain()
        self.channels.start(channel, request.request_id, self._metered(self._decoded(request, reply)))
        return Accepted(replica_id())

    async def submit(self, request: GenerationRequest, channel: str, pinned: str | None = None) -> Accepted:
        """_StreamingServer's (D's local prefill, or D alone), its request moved too if Serve drains
        this replica (``_watch_drain``)."""
        self._watch_drain()
        return await super().submit(request, channel, pinned)

    def _watch_drain(self) -> None:
        """Start, once, the task that moves this replica's running requests to other D replicas
        when Serve drains it (scale-down, redeploy: deployments/replicas/draining.py): each request's
        channel then ends with its ``Moved`` (its KV, tokens so far and sampler state) and the
        ingress has another D go on from it (deployments/pd/backends.py). Requests that cannot move
        yet (waiting, receiving their KV) move once they run; a beam search stays and ends here."""
        if self._drain_watch is None:
            self._drain_watch = asyncio.get_running_loop().create_task(self._move_out_when_drained())

    async def _move_out_when_drained(self) -> None:
        while not serve_draining():
            await asyncio.sleep(DRAIN_POLL_S)
        logger.info("Serve drains this replica: its running requests move to other decode replicas")
        while True:
            if self.engine.stats().requests:
                self.engine.move_out()
            await asyncio.sleep(DRAIN_POLL_S)

    async def _metered(self, batches: AsyncIterator[list]) -> AsyncIterator[list]:
        """_StreamingServer's, for D's items: a KV fetch's record is not metered, and a request's
        ``Moved`` (its last item) is stamped with this replica, its KV sent by reference (the KV
        connector's ``export``: the channel's item stays small, far below Serve's gRPC message limit)."""
        previous = None  # when the stream sent its last batch
        async for batch in batches:
            if isinstance(batch[-1], Moved):
                batch[-1].replica = replica_id()
                batch[-1].by_reference(self.kv.export)
            outputs = [item for item in batch if not isinstance(item, (Moved, KVTransfer))]
            if outputs:
                previous = self.meter.sent(outputs, previous)
            yield batch

    async def _decoded(self, request: GenerationRequest, reply: PrefillReply) -> AsyncIterator[list]:
        lora = await self.loras.adapter(request.lora)  # on the channel: its heartbeats cover a slow fetch
        async with aclosing(self.engine.decode_batches(request, reply.handoff, lora)) as batches:
            async for batch in batches:
                outputs = [item for item in batch if not isinstance(item, KVWanted)]
                if len(outputs) < len(batch):  # KVWanted: no token can precede it (they need the KV)
                    data, transfer = await self.kv.fetch(request.request_id, reply)
                    self.engine.receive_kv(request.request_id, data)
                    yield [transfer]
                if outputs:
                    yield outputs

    def hang_next_fetch(self, seconds: float) -> None:
        """The tests' fault hook: this replica's next KV fetch takes ``seconds`` longer, as over a slow
        or stuck link (KVConnector.fetch); refused as ``hang_next_step`` is."""
        _fault_hooks_on()
        self.kv.hang_next_s = seconds
