"""The ingress's generation routes in process, with an engine behind them: what the tests that
need the real routes' bodies (admission, the timeout rule, streaming, the dialects' answers) but
not Ray's transport use (tests/test_seed_examples.py, test_anthropic_thinking.py,
test_responses_reasoning.py).

``InProcessApp``: a FastAPI app whose routes call the ingress's own route methods
(deployments/ingress/ingress.py, ``Ingress.func_or_class.<route>``) on a view holding what they read of
the ingress (the dialects' serving objects, the Responses store), with the real app's error
handlers (dialects/http_edge.py, as deployments/ingress/ingress.py's build_app installs them), the real engine client (deployments/ingress/engine_client.py:
admission, traces, first-output handling) and an AsyncEngine in this process behind it. Requests
run on one event loop in a thread of its own, as a served replica's do; ``post`` sends one,
``transport`` lets an SDK's own client (openai's httpx, anthropic's httpx2) send them. The served
routes, Ray included, are tested in tests/test_api_*.py and tests/test_serve_pd.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
import threading
import time
from types import SimpleNamespace
from typing import Callable
import weakref

from fastapi import FastAPI, Request
import httpx

from deployments.ingress.admission import Admission
from deployments.config import AppArgs
from deployments.ingress.engine_client import ServeEngineClient, on_unexpected_error
from deployments.ingress.ingress import Ingress, served_settings
from dialects.databricks import DatabricksServing
from dialects.http_edge import install_error_handlers
from dialects.mindie_serving import MindIEServing
from dialects.openai_serving import OpenAIServing
from dialects.responses import ResponseStore
from engine.async_engine import AsyncEngine
from engine.model_info import ModelInfo

# path -> the ingress's route method that answers it (each takes (self, body, http)).
ROUTES = {"/infer_token": "infer_token", "/v1/chat/completions": "chat_completions",
          "/v1/completions": "completions", "/v1/responses": "create_response", "/v1/messages": "messages",
          "/serving-endpoints/{name}/invocations": "invocations"}
WAIT_S = 120  # one request's bound: a loaded 2-core box's first steps, never a verdict


class EngineHandle:
    """What the engine client asks of an engine deployment's handle, in process: ``info.remote()``.
    ``tokenizer_dir``: where the client loads its tokenizer from (the model's directory unless
    given: a copy of the tokenizer with another chat template serves the same weights with it)."""

    def __init__(self, engine: AsyncEngine, tokenizer_dir: Path | None = None) -> None:
        self.info = SimpleNamespace(remote=lambda: self._info(engine.engine, tokenizer_dir))

    @staticmethod
    async def _info(inner, tokenizer_dir: Path | None) -> ModelInfo:
        return ModelInfo(str(tokenizer_dir or inner.loaded.path), inner.loaded.model_id, inner.vocab_size,
                         inner.max_model_len, inner.config.max_iter_times, "in-process", inner.dtype,
                         inner.config.enable_prefix_caching, inner.pad_token_id, inner.loaded.spec.hidden_size,
                         inner.runner.attention.name, inner.runner.batch_invariant,
                         inner.runner.sampler.backend_name, inner.loaded.weight_storage)


class InProcessBackend:
    """deployments/pd/backends.py's ColocatedBackend with the engine in this process."""

    def __init__(self, engine: AsyncEngine, tokenizer_dir: Path | None = None) -> None:
        self.engine, self.handles = engine, {"LLMServer": EngineHandle(engine, tokenizer_dir)}

    def stream(self, request, trace=None):
        return self.engine.generate_batches(request)


def ingress_view(engine: AsyncEngine, args: AppArgs, tokenizer_dir: Path | None = None) -> SimpleNamespace:
    """What the ingress's generation routes read of ``self``, built as Ingress.__init__ builds it
    for a colocated app of ``args``."""
    client = ServeEngineClient(served_settings(args, pd=False, serves_lora=False),
                               InProcessBackend(engine, tokenizer_dir),
                               Admission(None, "LLMServer", args.admission_tokens_per_replica,
                                         args.max_ongoing_requests, lambda _: 1),
                               args.max_migrations, lambda trace, outcome: None)
    openai = OpenAIServing(client)
    return SimpleNamespace(openai=openai, mindie=MindIEServing(client), databricks=DatabricksServing(openai),
                           responses=ResponseStore())


def routes_app(view_of: Callable[[], SimpleNamespace]) -> FastAPI:
    """ROUTES bound to the ingress's methods on ``view_of()``, with the real app's error handlers
    (each answering in its route's dialect) and what its middleware sets for the routes."""
    app = FastAPI()
    install_error_handlers(app, on_unexpected_error)

    @app.middleware("http")
    async def arrival(request: Request, call_next):
        request.state.arrival, request.state.rate_key = time.time(), None
        return await call_next(request)

    for path, name in ROUTES.items():
        app.post(path)(bound(view_of, getattr(Ingress.func_or_class, name)))
    return app


def bound(view_of: Callable[[], SimpleNamespace], method):
    """``method`` (the ingress's route) as a route function of (body, http) on ``view_of()``, its
    body's type the route's own; the path's parameters (Databricks' endpoint name) by name. The view
    is looked up at each call, not held: FastAPI keeps every route function in a module-level cache
    (fastapi.dependencies.models), and a route holding its view kept the view's engine, KV pool and
    weights, in the driver for the rest of the suite."""
    async def route(body, http: Request):
        return await method(view_of(), body=body, http=http, **http.path_params)

    route.__annotations__ = {"body": method.__annotations__["body"], "http": Request}
    return route


class InProcessApp:
    """ROUTES over ``engine`` (an AsyncEngine, shut down by ``close`` where ``owns_engine``),
    served on an event loop of its own thread."""

    def __init__(self, engine: AsyncEngine, args: AppArgs, tokenizer_dir: Path | None = None,
                 owns_engine: bool = True) -> None:
        self.engine, self._owns_engine = engine, owns_engine
        self.view = ingress_view(engine, args, tokenizer_dir)
        this = weakref.ref(self)  # the routes outlive the app in FastAPI's cache (bound)
        self.app = routes_app(lambda: this().view)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="in-process-app", daemon=True)
        self._thread.start()

    async def _send(self, method: str, path: str, content: bytes, headers: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://in-process") as client:
            response = await client.request(method, path, content=content, headers=headers, timeout=WAIT_S)
            await response.aread()
            return response

    def send(self, method: str, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
        """One request, answered whole (a stream's events all in its text)."""
        return self.run(self._send(method, path, content, headers or {}))

    def run(self, coroutine):
        """``coroutine``'s result, run on the app's loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(WAIT_S)

    def frontend(self):
        """The routes' OpenAIFrontend (dialects/openai_api.py): its tokenizer has the served template."""
        return self.run(self.view.openai.frontend())

    def post(self, path: str, json: dict) -> httpx.Response:
        return self.send("POST", path, httpx.Request("POST", "http://x", json=json).content,
                         {"content-type": "application/json"})

    def transport(self, library=httpx):
        """A transport of ``library`` (httpx, or httpx2: the anthropic SDK's) that sends to the app."""
        def handle(request):
            answer = self.send(request.method, request.url.path, request.read(),
                               dict(request.headers))
            return library.Response(answer.status_code, headers=answer.headers.multi_items(),
                                    content=answer.content)
        return library.MockTransport(handle)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        if self._owns_engine:
            self.engine.shutdown()
