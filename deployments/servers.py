"""The engine deployments: P, D, and both in one (colocated).

Each replica owns one AsyncEngine. ``max_ongoing_requests`` is set high (AppArgs) so that
the engine's own priority scheduler, not Ray Serve's FIFO routing, orders the requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import logging
import time
from typing import AsyncIterator

import numpy as np
import ray
from ray import serve

from deployments.tracing import KVTransfer
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_transfer import KVPayload
from engine.outputs import KVWanted, PrefillResult, RequestOutput
from engine.request import GenerationRequest

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    """What the ingress needs to know about the engine behind a deployment."""

    model_path: str
    model_id: str
    vocab_size: int
    max_model_len: int
    max_iter_times: int
    node_id: str
    dtype: str
    enable_prefix_caching: bool


@dataclass
class DecodeAccepted:
    """D's first item: it has taken the request (and a reference to its KV)."""


@dataclass
class PrefillReply:
    """P's answer: each choice's first-token output and, unless P finished every choice, the
    handoff for D: the prefill result without its KV bytes. The ingress adds the reference to
    those bytes in Ray's object store (one for all choices; PDBackend): in a list, so that Ray
    passes it on to D instead of resolving it."""

    outputs: list[RequestOutput]
    handoff: PrefillResult | None
    kv_ref: list[ray.ObjectRef] = field(default_factory=list)


class _EngineServer:
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine = AsyncEngine(engine_config)

    def info(self) -> ModelInfo:
        inner = self.engine.engine
        return ModelInfo(str(inner.loaded.path), inner.loaded.model_id, inner.vocab_size, inner.max_model_len,
                         inner.config.max_iter_times, ray.get_runtime_context().get_node_id(), inner.dtype,
                         inner.config.enable_prefix_caching)

    def stats(self):
        return self.engine.stats()

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop has died."""
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:
        self.engine.shutdown()


@serve.deployment(ray_actor_options={"num_cpus": 1})
class LLMServer(_EngineServer):
    """Prefill and decode in one engine: small deployments, and the baseline for PD."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        async for output in self.engine.generate(request):
            yield output


@serve.deployment(ray_actor_options={"num_cpus": 1})
class PrefillServer(_EngineServer):
    async def prefill(self, request: GenerationRequest) -> AsyncIterator[PrefillReply | np.ndarray]:
        """P's reply, then, unless the first token ended every choice, the prompt's KV bytes
        [L, 2, T, Hkv, D] as a second item. Ray stores each item of a stream as an object owned
        by the caller (the ingress), not by this replica: the KV stays readable on this node if
        this replica dies or is scaled down after it answered (``ray.put`` here would lose it)."""
        outputs = await self.engine.prefill(request)
        result = next((o.prefill for o in outputs if o.prefill is not None), None)
        outputs = [replace(o, prefill=None) for o in outputs]  # the KV bytes travel apart, once
        if result is None:
            yield PrefillReply(outputs, None)
            return
        yield PrefillReply(outputs, replace(result, kv=KVPayload(result.kv.meta, None)))
        yield result.kv.data


@serve.deployment(ray_actor_options={"num_cpus": 1})
class DecodeServer(_EngineServer):
    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        self.transfers = {"count": 0, "bytes": 0, "seconds": 0.0}

    async def decode(self, request: GenerationRequest, reply: PrefillReply
                     ) -> AsyncIterator[DecodeAccepted | KVTransfer | RequestOutput]:
        """Take the request (``DecodeAccepted`` at once: the ingress's lease ends there), queue it
        in the engine without its KV, fetch the KV from the object store once the engine holds
        blocks for it (``KVWanted``), then stream the tokens after the first. Yields the fetch's
        KVTransfer (for the request's trace) before them."""
        yield DecodeAccepted()
        async for item in self.engine.decode(request, reply.handoff):
            if not isinstance(item, KVWanted):
                yield item
                continue
            start = time.time()
            data = await reply.kv_ref[0]  # zero-copy for numpy when the object is on this node
            transfer = KVTransfer(data.nbytes, start, time.time())
            self._record_transfer(transfer)
            self.engine.receive_kv(request.request_id, data)
            yield transfer

    def _record_transfer(self, transfer: KVTransfer) -> None:
        self.transfers["count"] += 1
        self.transfers["bytes"] += transfer.nbytes
        self.transfers["seconds"] += transfer.end - transfer.start

    def kv_transfers(self) -> dict:
        """Transfers into this replica so far: count, bytes, seconds."""
        return dict(self.transfers)
