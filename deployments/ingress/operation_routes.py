"""What the ingress's operations routes answer: /health, the model list, the OpenAPI schema and its
docs, the page at / and the traces it draws, /metrics. Plain functions of what each reads (the
readiness, the OpenAI serving object, the engine client, the traces, the metrics); the routes
themselves are the Ingress's methods (deployments/ingress/ingress.py), one line each, as Ray Serve finds
routes on the ingress class.
"""

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from deployments.pd.backends import PDBackend
from deployments.ingress.engine_client import ENGINE_WAIT_S, ServeEngineClient
from deployments.ingress.health import Readiness
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress.tracing import RecentTraces
from dialects.errors import APIError
from dialects.openai_serving import OpenAIServing
from dialects.openapi_doc import Served, openapi_schema

WEB_PAGE = (Path(__file__).parents[1] / "web" / "index.html").read_text()  # GET /: try the model in a browser


async def health(readiness: Readiness):
    ready, body = await readiness.check()
    return body if ready else JSONResponse(body, status_code=503)


async def models(openai: OpenAIServing) -> dict:
    return {"object": "list", "data": await openai.model_cards()}


async def model(openai: OpenAIServing, model_id: str) -> dict:
    for card in await openai.model_cards():
        if card["id"] == model_id:
            return card
    raise APIError(404, f"model: {model_id!r} is not served here", "model", "model_not_found")


async def openapi_document(app: FastAPI, engines: ServeEngineClient, embedder) -> tuple[dict, bool]:
    """(the schema, whether to keep it): with this deployment's limits once the engines answer;
    without them, and not to be kept, while they are not ready."""
    try:
        info = await asyncio.wait_for(engines.model_info(), ENGINE_WAIT_S)
        served = Served(engines.settings.served_model_name, info, list(await engines.lora_names()))
        if embedder is not None:
            served.embedding_name, served.embedding_vocab = await asyncio.wait_for(
                asyncio.gather(embedder.info.remote(), embedder.vocab_size.remote()), ENGINE_WAIT_S)
    except Exception:
        return openapi_schema(app, None), False
    return openapi_schema(app, served), True


def docs_page(app: FastAPI, http: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=f"{http.scope.get('root_path', '')}/openapi.json", title=app.title)


def web_page() -> HTMLResponse:
    """One page to try the model: a message, its answer streamed, and the request's phases
    (deployments/web/index.html; it reads /v1/models, /v1/chat/completions and /traces)."""
    return HTMLResponse(WEB_PAGE)


def trace(traces: RecentTraces, backend, request_id: str) -> dict:
    ended = traces.find(request_id)
    if not ended:
        raise APIError(404, f"request_id: no ended request {request_id!r} among this ingress's last "
                       f"{traces.capacity}", "request_id", "not_found")
    return {"id": request_id, "app": "pd" if isinstance(backend, PDBackend) else "colocated", "requests": ended}


async def prometheus(metrics: IngressMetrics, backend) -> PlainTextResponse:
    return PlainTextResponse(await metrics.render(backend), media_type="text/plain; version=0.0.4")
