"""The engine client on Ray Serve: dialects/engine_client.py's seam, implemented. One per ingress
replica; it holds the backend (colocated, or P then D: deployments/pd/backends.py), and every request
goes through admission (admission.py), migration (migration.py) and its trace (tracing.py) here,
so that a dialect sees outputs and APIErrors, never Ray.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable
import uuid

from transformers import AutoTokenizer

from deployments.ingress.admission import Admission, Overloaded, admitted
from deployments.failures import client_error
from deployments.ingress.health import describe
from deployments.ingress.migration import migrating
from deployments.ingress.streams import indexed, prepend_first
from deployments.ingress.tracing import RequestTrace, traced
from dialects.engine_client import Origin, ServedSettings
from dialects.errors import APIError
from engine.lora_adapter import LoraAdapter, LoraRef, ModelShape
from engine.model_info import ModelInfo
from engine.outputs import TIMEOUT, RequestOutput
from engine.request import GenerationRequest

ENGINE_WAIT_S = 5.0  # the longest any endpoint waits for a deployment's info before a 503


class ServeGeneration:
    """dialects/engine_client.py's Generation: the started requests' streams, merged; any failure
    out of them becomes the APIError a client is told (deployments/failures.py)."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]], first_trace: RequestTrace) -> None:
        self._outputs = indexed(streams)
        self._trace = first_trace

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            async for item in self._outputs:
                yield item
        except Exception as error:
            raise client_error(error) from None
        finally:
            await self.abort()  # a client that went away cancels the engines' calls at once

    async def abort(self) -> None:
        await self._outputs.aclose()

    @property
    def ttft_s(self) -> float:
        return self._trace.phases().get("ttft", 0.0)

    @property
    def last_gap_s(self) -> float:
        return self._trace.last_gap


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
        # (stream, key name, request) -> the stream, its tokens counted against the key: RateLimiter.metered
        self.meter: Callable[[AsyncIterator[RequestOutput], str, GenerationRequest], AsyncIterator[RequestOutput]] = (
            lambda stream, key_name, request: stream)

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
        try:
            calls = [h.info.remote() for h in self.backend.handles.values()]
            infos = await asyncio.wait_for(asyncio.gather(*calls), ENGINE_WAIT_S)
        except Exception as error:
            raise APIError(503, f"the engines are not ready ({describe(error)}); GET /health says which",
                           code="not_ready") from None
        if len({i.model_id for i in infos}) != 1:
            raise APIError(503, "the prefill and decode deployments serve different models")
        return infos[0]

    async def tokenizer(self):
        if self._tokenizer is None:
            info = await self.model_info()
            self._tokenizer = AutoTokenizer.from_pretrained(info.model_path, local_files_only=True)
        return self._tokenizer

    async def generate(self, requests: list[GenerationRequest], origin: Origin) -> ServeGeneration:
        started = await asyncio.gather(*(self._start(r, origin) for r in requests), return_exceptions=True)
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            for s in started:
                if not isinstance(s, BaseException):
                    await s[1].aclose()
            raise errors[0]
        return ServeGeneration([prepend_first(first, stream) for first, stream, _ in started], started[0][2])

    async def _start(self, request: GenerationRequest, origin: Origin
                     ) -> tuple[RequestOutput, AsyncIterator[RequestOutput], RequestTrace]:
        """Send a request to the engines and wait for its first output: errors and a deadline
        that passes before the first token become HTTP errors before any byte is sent. The
        request's trace ends with its stream."""
        trace = RequestTrace(origin.client_request_id or uuid.uuid4().hex, request.request_id, origin.dialect,
                             request.priority, len(request.prompt_token_ids), origin.arrival)
        def on_migrate() -> None:
            trace.migrations += 1

        try:
            ticket = self.admission.admit(request)
        except Overloaded as error:  # at once, never a wait: deployments/ingress/admission.py
            raise APIError(503, str(error), code="overloaded", retry_after=error.retry_after) from None
        resilient = migrating(lambda r: self.backend.stream(r, trace), request, self.max_migrations, on_migrate)
        stream = self.meter(admitted(traced(resilient, trace, self.end_trace), ticket), origin.key_name, request)
        try:
            first = await stream.__anext__()
        except Exception as error:
            await stream.aclose()
            raise client_error(error) from None
        if first.finished and first.finish_reason == TIMEOUT and not first.new_token_ids:
            await stream.aclose()
            raise APIError(408, "request timed out: the request's timeout passed before its first token", "timeout",
                           "timeout")
        return first, stream, trace

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
