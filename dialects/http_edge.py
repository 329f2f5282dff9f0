"""The HTTP edge of the ingress's app in the dialects' terms: error responses in the route's dialect
(Anthropic's shape on Anthropic's routes, Databricks' on its invocations route, OpenAI's elsewhere,
with MindIE's err_msg beside it on /infer_token), the refusals at the door (401 without the API
key, 413 for a body over its bound), which routes count against a key's rate limits, and what a
generation route documents. The app itself, its middleware and its routes' binding are the
ingress's (deployments/ingress/ingress.py ``build_app``); nothing here knows Ray.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dialects import anthropic, auth, databricks, mindie
from dialects.errors import APIError, documented, error_response, on_api_error, on_http_error, on_validation_error
from dialects.openai_serving import SSE

# What a generation route can answer: JSON, or server-sent events when "stream" is true; 400 bad
# input, 404 a model not served, 408 a timeout (docs/api.md), 413 a body too large,
# 503 engines not ready or Ray Serve's back-pressure.
GENERATION = {200: {"content": {"application/json": {}, SSE: {}}},
              **documented(400, 404, 408, 413, 503)}
# The routes whose requests count against a key's limits (deployments/ingress/rate_limits.py):
# generation and embeddings, and Databricks' invocations (``rate_limited``).
LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                           "/v1/messages", "/infer_token"})


def rate_limited(path: str) -> bool:
    """Whether a request to ``path`` (below the route prefix) counts against its key's limits."""
    return path in LIMITED_PATHS or databricks.is_route(path)


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


def install_error_handlers(app: FastAPI, on_unexpected_error: Callable) -> None:
    """``app``'s error handlers, each answering in the route's dialect: APIErrors, validation errors,
    FastAPI's own (unknown routes, bad JSON) and any other exception (``on_unexpected_error``: what
    the serving system tells a client of its failures)."""
    app.add_exception_handler(APIError, in_route_dialect(on_api_error))
    app.add_exception_handler(RequestValidationError, in_route_dialect(on_validation_error))
    app.add_exception_handler(StarletteHTTPException, in_route_dialect(on_http_error))
    app.add_exception_handler(Exception, in_route_dialect(on_unexpected_error))


async def door_refusal(request: Request, path: str) -> JSONResponse | None:
    """401 on a model route without the API key (auth.py; ``app.state.api_key``), 413 for a body over
    ``app.state.max_body_bytes`` (an upload to /v1/files: ``max_upload_bytes``), in OpenAI's shape;
    None lets the request in."""
    state = request.app.state
    if not auth.is_open(path):
        try:
            auth.check_api_key(state.api_key, request.headers, x_api_key=anthropic.is_route(path))
        except APIError as error:
            refusal = error.response()
            refusal.headers["WWW-Authenticate"] = "Bearer"
            return refusal
    # An upload to /v1/files has its own bound (max_file_bytes, with room for the form around it).
    limit = state.max_body_bytes if path != "/v1/files" else state.max_upload_bytes
    declared = request.headers.get("content-length")
    if int(declared) > limit if declared and declared.isdigit() else len(await request.body()) > limit:
        return error_response(413, f"the request body exceeds {limit} bytes", None, "body_too_large")
    return None
