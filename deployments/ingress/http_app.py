"""The ingress's FastAPI app: its error handlers and its middleware, each answering in the route's
dialect (Anthropic's shape on Anthropic's routes, Databricks' on its invocations route, OpenAI's
elsewhere, with MindIE's err_msg beside it on /infer_token). The routes are the
Ingress's methods (deployments/ingress/ingress.py; the operations routes' answers in deployments/ingress/operation_routes.py).
"""

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.ingress.engine_client import on_unexpected_error
from deployments.ingress.metrics import IngressMetrics
from dialects import anthropic, auth, batch_routes, databricks, mindie
from dialects.errors import APIError, documented, error_response, on_api_error, on_http_error, on_validation_error
from dialects.openai_serving import SSE

# /openapi.json and /docs are the Ingress's own routes (deployments/ingress/ingress.py): the schema
# carries the served model's limits.
app = FastAPI(title="pdserve", description="LLM serving with prefill/decode disaggregation on Ray Serve",
              openapi_url=None, docs_url=None, redoc_url=None)
app.include_router(batch_routes.router)  # the Files and Batch APIs' routes: dialects/batch_routes.py


def in_dialect(path: str, response: JSONResponse) -> JSONResponse:
    """An error response in OpenAI's shape as the route at ``path`` answers it: Anthropic's and
    Databricks' in their own shapes, MindIE's with its ``err_msg`` beside OpenAI's object."""
    if anthropic.is_route(path):
        return anthropic.from_openai_error(response)
    if databricks.is_route(path):
        return databricks.from_openai_error(response)
    return mindie.with_err_msg(response) if mindie.is_route(path) else response


def in_route_dialect(handler):
    """An error handler whose answers take the route's dialect (``in_dialect``)."""
    async def handle(request: Request, error: Exception) -> JSONResponse:
        return in_dialect(auth.route_path(request.scope), await handler(request, error))
    return handle


app.add_exception_handler(APIError, in_route_dialect(on_api_error))
app.add_exception_handler(RequestValidationError, in_route_dialect(on_validation_error))
app.add_exception_handler(StarletteHTTPException, in_route_dialect(on_http_error))
app.add_exception_handler(Exception, in_route_dialect(on_unexpected_error))

# What a generation route can answer: JSON, or server-sent events when "stream" is true; 400 bad
# input, 404 a model not served, 408 a timeout (docs/api.md), 413 a body too large,
# 503 engines not ready or Ray Serve's back-pressure.
GENERATION = {200: {"content": {"application/json": {}, SSE: {}}},
              **documented(400, 404, 408, 413, 503)}


@app.middleware("http")
async def limit_and_count(request: Request, call_next):
    """401 on a model route without the API key (dialects/auth.py), 413 for bodies over the cap,
    429 past the key's rate limits, each in the route's dialect; count every request by endpoint,
    status and priority."""
    request.state.arrival = time.time()  # the start of the request's trace (deployments/ingress/tracing.py)
    path, refusal = auth.route_path(request.scope), None
    if not auth.is_open(path):
        try:
            auth.check_api_key(request.app.state.api_key, request.headers, x_api_key=anthropic.is_route(path))
        except APIError as error:
            refusal = error.response()
            refusal.headers["WWW-Authenticate"] = "Bearer"
    # An upload to /v1/files has its own bound (max_file_bytes, with room for the form around it).
    limit = request.app.state.max_body_bytes if path != "/v1/files" else request.app.state.max_upload_bytes
    declared = request.headers.get("content-length")
    if refusal is None and (int(declared) > limit if declared and declared.isdigit()
                            else len(await request.body()) > limit):
        refusal = error_response(413, f"the request body exceeds {limit} bytes", None, "body_too_large")
    if refusal is None and (limiter := getattr(request.app.state, "rate_limits", None)) is not None:
        refusal = await limiter.refusal(request, path)  # 429 past the key's limits: deployments/ingress/rate_limits.py
    if refusal is not None:
        response = in_dialect(path, refusal)
    else:
        response = await call_next(request)
    metrics: IngressMetrics = request.app.state.metrics
    route = request.scope.get("route")  # the matched route's template: bounded label values
    metrics.requests.labels(route.path if route else "unmatched", str(response.status_code),
                            str(getattr(request.state, "priority", "-"))).inc()
    return response
