"""The engine client on Ray Serve: dialects/engine_client.py's seam, implemented. One per ingress
replica; it holds the backend (colocated, or P then D: deployments/pd/backends.py). Each request is
admitted (admission.py) and started as a request flow (request_flow.py: its trace, migration, the
ticket's release and its key's tokens), so that a dialect sees outputs and APIErrors, never Ray.

It is also where the serving system's failures become what a client is told (``client_error``):
a status it can act on and a message with nothing of Ray's in it, the cause in the server log. The
rest of deployments/ raises its own types (deployments/failures.py, admission's ``Overloaded``)
and never imports a dialect; this mapping is the one place they meet the dialects' ``APIError``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

from deployments.failures import (REPLICA_FAILURES, REPLICA_RETRY_AFTER_S, DeadlineBeforeFirstToken, LateReplacement,
                                  NoDecodeReplica, NoPrefillReplica, RateCounterDown, RateLimited, root_cause)
from deployments.ingress.admission import Admission, Overloaded
from deployments.ingress.health import describe
from deployments.ingress.request_flow import RequestFlow, ServeGeneration, started
from deployments.ingress.tracing import RequestTrace
from dialects.engine_client import Origin, ServedSettings
from dialects.errors import APIError, from_value_error
from engine.lora_adapter import LoraAdapter, LoraRef, ModelShape
from engine.model_info import ModelInfo
from engine.request import GenerationRequest

ENGINE_WAIT_S = 5.0  # the longest any endpoint waits for a deployment's info before a 503
logger = logging.getLogger("ray.serve")


class ServeEngineClient:
    """The engines behind one ingress replica, as the dialects see them."""

    def __init__(self, settings: ServedSettings, backend, admission: Admission, max_migrations: int,
                 end_trace: Callable[[RequestTrace, str], None], lora_store=None, embedder=None) -> None:
        """``backend``: a ColocatedBackend or PDBackend; ``end_trace(trace, outcome)``: the ingress's
        record of each ended request; ``lora_store``: the app's LoraStore handle (None: no adapters);
        ``embedder``: the EmbeddingServer handle (None: no embeddings)."""
        self.settings = settings
        self.backend, self.admission, self.max_migrations = backend, admission, max_migrations
        self.end_trace = end_trace
        self.lora_store, self.embedder = lora_store, embedder
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._tokenizer = None
        self._lora_names: dict[str, LoraRef] | None = None
        self._lora_shape: ModelShape | None = None
        # (key name, tokens) counted against the key: RateLimiter.charge (None: no per-key limits)
        self.charge: Callable[[str, int], None] | None = None
        # Engine requests of interactive origins (not batch lines) running now: the batch runner
        # sends no new line while any does (deployments/ingress/batch_runner.py).
        self.interactive_in_flight = 0

    async def model_info(self) -> ModelInfo:
        """What the engines serve; a 503 within ENGINE_WAIT_S while one of them does not answer.
        Concurrent first callers share one round of calls (a burst of first requests would otherwise
        send one each to every deployment, and the last ones would wait behind the others)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    self._info = await self._ask_info()
        return self._info

    async def _ask_info(self) -> ModelInfo:
        """Every engine deployment's answer (a 503 while one does not answer: an app whose D was never
        placed is not ready), and P's taken: a P and a D that serve different models, or the same one
        differently, are never paired (deployments/pd/compatibility.py), so the app serves P's model."""
        try:
            calls = [h.info.remote() for h in self.backend.handles.values()]
            infos = await asyncio.wait_for(asyncio.gather(*calls), ENGINE_WAIT_S)
        except Exception as error:
            raise APIError(503, f"the engines are not ready ({describe(error)}); GET /health says which",
                           code="not_ready") from None
        return infos[0]

    async def tokenizer(self):
        if self._tokenizer is None:
            info = await self.model_info()
            self._tokenizer = AutoTokenizer.from_pretrained(info.model_path, local_files_only=True)
        return self._tokenizer

    async def generate(self, requests: list[GenerationRequest], origin: Origin) -> ServeGeneration:
        """Admit and start each request (a 503 at once when one does not fit), then wait for every
        first output (request_flow.started: errors and a deadline passed before it are HTTP errors)."""
        queue: asyncio.Queue = asyncio.Queue()
        flows: list[RequestFlow] = []
        generation = ServeGeneration(flows, queue, client_error)
        for index, request in enumerate(requests):
            request.background = origin.background  # a batch line's requests yield to interactive ones
            try:
                ticket = self.admission.admit(request)
            except Overloaded as error:  # at once, never a wait: deployments/ingress/admission.py
                await generation.abort()
                raise client_error(error) from None
            trace = RequestTrace(origin.client_request_id or uuid.uuid4().hex, request.request_id, origin.dialect,
                                 request.priority, len(request.prompt_token_ids), origin.arrival)
            if self.charge is not None:
                self.charge(origin.key_name, request.num_context_tokens)
            flows.append(RequestFlow(index, request, lambda r, trace=trace: self.backend.stream(r, trace), trace,
                                     ticket, self.max_migrations, self._ended(origin), queue))
            self.interactive_in_flight += not origin.background
        return await started(generation, flows)

    def _ended(self, origin: Origin):
        """A flow's end: its trace recorded, its generated tokens charged to its key."""
        def end(flow: RequestFlow, outcome: str) -> None:
            self.interactive_in_flight -= not origin.background
            self.end_trace(flow.trace, outcome)
            if self.charge is not None:
                self.charge(origin.key_name, flow.generated)
        return end

    async def lora_names(self) -> dict[str, LoraRef]:
        if self._lora_names is None:
            self._lora_names = {} if self.lora_store is None else await _answer(self.lora_store.names.remote())
        return self._lora_names

    async def lora_task(self, task_id: int) -> LoraRef | None:
        return await _answer(self.lora_store.task.remote(task_id))

    async def lora_shape(self) -> ModelShape:
        if self._lora_shape is None:
            self._lora_shape = await _answer(self.lora_store.shape.remote())
        return self._lora_shape

    async def put_lora_task(self, task_id: int, adapter: LoraAdapter) -> LoraRef:
        return await _answer(self.lora_store.put_task.remote(task_id, adapter))

    async def embedding_model(self) -> str | None:
        if self.embedder is None:
            return None
        try:
            return await asyncio.wait_for(self.embedder.info.remote(), ENGINE_WAIT_S)
        except Exception as error:
            raise APIError(503, f"the embeddings deployment is not ready ({describe(error)})",
                           code="not_ready") from None

    async def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        result = await _answer(self.embedder.embed.remote(inputs))
        return result.vectors, result.prompt_tokens


async def _answer(call):
    """A deployment call's answer; its failure as the APIError a client is told."""
    try:
        return await call
    except Exception as error:
        raise client_error(error) from None


def client_error(error: BaseException) -> APIError:
    """What the client is told of ``error``; anything but a request error or a refusal is logged with
    its cause (Serve's log lines carry the request id). Ray's text (exception names, pids, node
    addresses, tracebacks) never reaches a client."""
    cause = root_cause(error)
    if isinstance(cause, APIError):
        return cause
    if isinstance(cause, ValueError):  # the engines' checks of a request: "<field>: <rule>"
        return from_value_error(cause)
    if isinstance(cause, Overloaded):
        return APIError(503, str(cause), code="overloaded", retry_after=cause.retry_after)
    if isinstance(cause, RateLimited):
        return APIError(429, str(cause), None, "rate_limit_exceeded", retry_after=cause.retry_after)
    if isinstance(cause, RateCounterDown):
        return APIError(503, str(cause), code="not_ready")
    if isinstance(cause, DeadlineBeforeFirstToken):
        return APIError(408, str(cause), "timeout", "timeout")
    if isinstance(cause, LateReplacement):
        return APIError(503, str(cause), code="replica_unavailable", retry_after=REPLICA_RETRY_AFTER_S)
    logger.warning("request failed: %s: %s", type(cause).__name__, cause)
    if isinstance(cause, NoDecodeReplica):
        return APIError(503, "no decode replica is available; retry it", code="no_decode_replica",
                        retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, NoPrefillReplica):
        return APIError(503, "no prefill replica is available; retry it", code="no_prefill_replica",
                        retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, REPLICA_FAILURES):
        return APIError(503, "a replica serving this request failed or is unavailable; retry it",
                        code="replica_unavailable", retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, TimeoutError):
        return APIError(504, "the engines did not answer in time; retry it", code="engine_timeout")
    return APIError(500, "the server failed while serving this request; its log has the cause under the "
                         "request's x-request-id", code="internal_error")


async def on_unexpected_error(_: Request, error: Exception) -> JSONResponse:
    """Any other exception out of a route, in OpenAI's shape with nothing of Ray's in it."""
    return client_error(error).response()
