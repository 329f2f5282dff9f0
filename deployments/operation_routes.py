"""The ingress's operations routes: /health, the model list, the OpenAPI schema and its docs, the
page at / and the traces it draws, /metrics. A mixin of the Ingress (deployments/ingress.py):
it reads the Ingress's readiness, engine client, OpenAI routes, embedder, traces, backend and metrics.
Ray Serve finds these routes through the Ingress's bases.
"""

import asyncio
from pathlib import Path

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from deployments.backends import PDBackend
from deployments.engine_client import ENGINE_WAIT_S
from deployments.http_app import app
from dialects.errors import APIError, documented
from dialects.openapi_doc import Served, openapi_schema

WEB_PAGE = (Path(__file__).parent / "web" / "index.html").read_text()  # GET /: try the model in a browser


class OperationRoutes:
    @app.get("/health", responses={503: {"description": "not ready: which deployment, and why"}})
    async def health(self):
        """200 once a canary request went through every engine deployment (P, the KV hand-off
        and D; or the colocated engine) within the last seconds; else 503 naming each deployment
        that is missing, pending or failing (deployments/health.py)."""
        ready, body = await self.readiness.check()
        return body if ready else JSONResponse(body, status_code=503)

    @app.get("/v1/models", responses=documented(503))
    async def models(self):
        return {"object": "list", "data": await self.openai.model_cards()}

    @app.get("/v1/models/{model_id}", responses=documented(404, 503))
    async def model(self, model_id: str):
        for card in await self.openai.model_cards():
            if card["id"] == model_id:
                return card
        raise APIError(404, f"model: {model_id!r} is not served here", "model", "model_not_found")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        """The schema with this deployment's limits (without them while the engines are not ready)."""
        if self._openapi is None:
            try:
                info = await asyncio.wait_for(self.engines.model_info(), ENGINE_WAIT_S)
                served = Served(self.engines.settings.served_model_name, info, list(await self.engines.lora_names()))
                if self.embedder is not None:
                    served.embedding_name, served.embedding_vocab = await asyncio.wait_for(
                        asyncio.gather(self.embedder.info.remote(), self.embedder.vocab_size.remote()),
                        ENGINE_WAIT_S)
            except Exception:  # not ready: the schema without the model's limits, not cached
                return openapi_schema(app, None)
            self._openapi = openapi_schema(app, served)
        return self._openapi

    @app.get("/docs", include_in_schema=False)
    async def docs(self, http: Request):
        return get_swagger_ui_html(openapi_url=f"{http.scope.get('root_path', '')}/openapi.json", title=app.title)

    @app.get("/", include_in_schema=False)
    async def web_page(self):
        """One page to try the model: a message, its answer streamed, and the request's phases
        (deployments/web/index.html; it reads /v1/models, /v1/chat/completions and /traces)."""
        return HTMLResponse(WEB_PAGE)

    @app.get("/traces/{request_id}", responses=documented(404))
    async def trace(self, request_id: str):
        """The recorded phases of a request that ended on this ingress replica (one of its last
        1024): a response id (chatcmpl-…, its engine requests) or an engine request id."""
        ended = self.traces.find(request_id)
        if not ended:
            raise APIError(404, f"request_id: no ended request {request_id!r} among this ingress's last "
                           f"{self.traces.capacity}", "request_id", "not_found")
        return {"id": request_id, "app": "pd" if isinstance(self.backend, PDBackend) else "colocated",
                "requests": ended}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus(self):
        return PlainTextResponse(await self.metrics.render(self.backend),
                                 media_type="text/plain; version=0.0.4")
