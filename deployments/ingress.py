"""The HTTP ingress: validates requests and streams the engines' tokens back.

One FastAPI app behind ``@serve.ingress``; it holds handles to the engine deployments
(deployments/backends.py) and never runs a model itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from ray import serve

from deployments import mindie
from deployments.backends import ColocatedBackend, PDBackend
from deployments.config import AppArgs
from deployments.errors import APIError, error_response, from_value_error, on_api_error, on_validation_error, \
    root_cause
from deployments.servers import ModelInfo
from engine.outputs import TIMEOUT, RequestOutput

app = FastAPI(title="pdserve", description="LLM serving with prefill/decode disaggregation on Ray Serve")
app.add_exception_handler(APIError, on_api_error)
app.add_exception_handler(RequestValidationError, on_validation_error)

HEALTH_TIMEOUT_S = 5.0


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class Ingress:
    def __init__(self, args: AppArgs, llm=None, prefill=None, decode=None) -> None:
        self.args = args
        self.backend = ColocatedBackend(llm) if llm is not None else PDBackend(prefill, decode)
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            infos = await asyncio.gather(*(h.info.remote() for h in self.backend.handles.values()))
            if len({i.model_id for i in infos}) != 1:
                raise APIError(503, "the prefill and decode deployments serve different models")
            self._info = infos[0]
        return self._info

    async def start(self, request) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Send a request to the engines and wait for its first output: errors and a deadline
        that passes before the first token become HTTP errors before any byte is sent."""
        stream = self.backend.stream(request)
        try:
            first = await stream.__anext__()
        except ValueError as error:
            raise from_value_error(error) from None
        except Exception as error:
            cause = root_cause(error)
            if isinstance(cause, ValueError):
                raise from_value_error(cause) from None
            raise
        if first.finished and first.finish_reason == TIMEOUT and not first.new_token_ids:
            raise APIError(408, "the request's timeout passed before its first token", "timeout", "timeout")
        return first, stream

    @app.post("/infer_token")
    async def infer_token(self, body: mindie.InferTokenRequest):
        info = await self.model_info()
        arrival = time.time()
        try:
            request = mindie.to_generation_request(body, f"infer-{uuid.uuid4().hex}",
                                                   arrival + body.parameters.timeout, info.vocab_size)
        except ValueError as error:
            raise from_value_error(error) from None
        first, stream = await self.start(request)
        if body.stream:
            return StreamingResponse(self._infer_token_events(first, stream, body, arrival),
                                     media_type="text/event-stream")
        try:
            outputs = [first] + [output async for output in stream]
        finally:
            await stream.aclose()  # on a cancelled request, cancels the engines' call at once
        return mindie.text_response(outputs, body)

    async def _infer_token_events(self, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                                  body: mindie.InferTokenRequest, arrival: float) -> AsyncIterator[str]:
        try:
            yield mindie.stream_event(first, body, True, (time.time() - arrival) * 1000.0)
            last = time.perf_counter()
            async for output in stream:
                now = time.perf_counter()
                yield mindie.stream_event(output, body, False, (now - last) * 1000.0)
                last = now
        except Exception as error:  # the stream has begun: end it with an error event
            yield f"data: {error_event(root_cause(error))}\n\n"
        finally:
            await stream.aclose()  # a client that went away cancels the engines' call at once

    @app.get("/health")
    async def health(self):
        """200 when every engine deployment answers; 503 otherwise."""
        try:
            await asyncio.wait_for(asyncio.gather(*(h.info.remote() for h in self.backend.handles.values())),
                                   HEALTH_TIMEOUT_S)
        except Exception as error:
            return error_response(503, f"engines not ready: {type(root_cause(error)).__name__}", code="not_ready")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        info = await self.model_info()
        return {"object": "list", "data": [{"id": self.served_model_name(info), "object": "model",
                                            "created": 0, "owned_by": "pdserve",
                                            "max_model_len": info.max_model_len}]}

    def served_model_name(self, info: ModelInfo) -> str:
        return self.args.served_model_name or self.args.model.rstrip("/").rsplit("/", 1)[-1]


def error_event(error: BaseException) -> str:
    return json.dumps({"error": {"message": str(error), "type": "server_error", "param": None, "code": "stream_error"}})
