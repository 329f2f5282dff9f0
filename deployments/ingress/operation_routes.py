"""What the ingress's operations routes answer: /health, the OpenAPI schema's docs page, the page at
/ and the traces it draws, /metrics. Plain functions of what each reads (the readiness, the traces,
the metrics); the routes themselves are the Ingress's methods (deployments/ingress/ingress.py), one
line each. What is a dialect's (the model list, the schema, a 404's body) is answered there.
"""

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from deployments.pd.backends import PDBackend
from deployments.ingress.health import Readiness
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress.tracing import RecentTraces

WEB_PAGE = (Path(__file__).parents[1] / "web" / "index.html").read_text()  # GET /: try the model in a browser


async def health(readiness: Readiness):
    ready, body = await readiness.check()
    return body if ready else JSONResponse(body, status_code=503)


def docs_page(app: FastAPI, http: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=f"{http.scope.get('root_path', '')}/openapi.json", title=app.title)


def web_page() -> HTMLResponse:
    """One page to try the model: a message, its answer streamed, and the request's phases
    (deployments/web/index.html; it reads /v1/models, /v1/chat/completions and /traces)."""
    return HTMLResponse(WEB_PAGE)


def trace(traces: RecentTraces, backend, request_id: str) -> dict | None:
    """The request's recorded phases, or None when none of the traces kept ended it."""
    ended = traces.find(request_id)
    if not ended:
        return None
    return {"id": request_id, "app": "pd" if isinstance(backend, PDBackend) else "colocated", "requests": ended}


async def prometheus(metrics: IngressMetrics, backend) -> PlainTextResponse:
    return PlainTextResponse(await metrics.render(backend), media_type="text/plain; version=0.0.4")
