"""Error bodies in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and what a
client is told of a failure (``client_error``): a status it can act on and a message with
nothing of Ray's in it; the cause goes to the server log."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
         413: "invalid_request_error", 503: "service_unavailable_error", 504: "timeout_error"}


class KVLeaseExpired(Exception):
    """No D replica took a request within its KV's lease (deployments/backends.py PDBackend)."""


class ReplicaStalled(Exception):
    """The replica serving a stream gave no sign of life for too long (deployments/liveness.py)."""


class PrefixLost(Exception):
    """A call pinned to the D replica that holds the request's prefix reached another one: that
    replica died or left (deployments/servers.py)."""


# What Ray and Serve raise when a replica died, is unreachable or lost an object; and a replica
# that did not take its KV in time or stalled mid-stream, which the ingress treats the same way.
REPLICA_FAILURES = (RayError, RayServeException, KVLeaseExpired, ReplicaStalled, PrefixLost)
REPLICA_RETRY_AFTER_S = 1  # Retry-After of a 503 when a replica failed: Serve routes around it, or restarts it
logger = logging.getLogger("ray.serve")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the API returns (documented per route in /openapi.json)."""

    error: ErrorDetail


def documented(*statuses: int) -> dict:
    """``responses=`` of a route: the error statuses it can return, with their body."""
    return {status: {"model": ErrorBody, "description": TYPES.get(status, "server_error")} for status in statuses}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def root_cause(error: BaseException) -> BaseException:
    """The exception a replica raised, without Ray's wrapper around it."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


def replica_failed(error: BaseException) -> bool:
    """Whether ``error`` says a replica died, is unreachable or lost an object the request needed
    (deployments/migration.py moves the request), not that the request itself was refused."""
    return isinstance(root_cause(error), REPLICA_FAILURES)


def client_error(error: BaseException) -> APIError:
    """What the client is told of ``error``; anything but a request error is logged with its cause
    (Serve's log lines carry the request id). Ray's text (exception names, pids, node addresses,
    tracebacks) never reaches a client."""
    cause = root_cause(error)
    if isinstance(cause, APIError):
        return cause
    if isinstance(cause, ValueError):  # the engines' checks of a request: "<field>: <rule>"
        return from_value_error(cause)
    logger.warning("request failed: %s: %s", type(cause).__name__, cause)
    if isinstance(cause, REPLICA_FAILURES):
        return APIError(503, "a replica serving this request failed or is unavailable; retry it",
                        code="replica_unavailable", retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, TimeoutError):
        return APIError(504, "the engines did not answer in time; retry it", code="engine_timeout")
    return APIError(500, "the server failed while serving this request; its log has the cause under the "
                         "request's x-request-id", code="internal_error")


def from_value_error(error: ValueError) -> APIError:
    """Engine and parameter checks say "<field>: <rule>"; the field becomes ``param``."""
    message = str(error)
    field, sep, _ = message.partition(":")
    param = field if sep and " " not in field else None
    return APIError(400, message, param, "invalid_value")


async def on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (a body that cannot be parsed, an unknown route or method) in OpenAI's shape."""
    code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    response = error_response(error.status_code, str(error.detail), None, code)
    response.headers.update(error.headers or {})  # 405's Allow
    return response


async def on_api_error(_: Request, error: APIError) -> JSONResponse:
    return error.response()


async def on_unexpected_error(_: Request, error: Exception) -> JSONResponse:
    """Any other exception out of a route, in OpenAI's shape with nothing of Ray's in it."""
    return client_error(error).response()


# Parts of a pydantic error location that name a member of a union, not a field.
UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "function-after", "function-before"}


def _is_field(part) -> bool:
    return isinstance(part, int) or (part != "body" and part not in UNION_TAGS and not any(c in part for c in "[-"))


async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if _is_field(part)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return error_response(400, "the body is not valid JSON", None, "invalid_json")
    if first.get("type") == "missing" and not location:
        return error_response(400, "the body is empty; a JSON object is required", None, "missing_body")
    message = first.get("msg", "")
    if len(location) < len([p for p in first.get("loc", ()) if p != "body"]):
        # A union's members each failed (prompt: a string, strings, token ids, ...): say why for each.
        reasons = [e.get("msg", "") for e in error.errors()
                   if [str(p) for p in e.get("loc", ()) if _is_field(p)][:len(location)] == location]
        message = "matches none of its accepted forms: " + "; ".join(dict.fromkeys(reasons))
    if first.get("type") == "value_error":
        message = message.removeprefix("Value error, ")
        # A check across fields says "<field>: <rule>" (openai_schema.py); the field is relative
        # to where the check ran (messages.2 for a message's own check).
        named = from_value_error(ValueError(message))
        if named.param:
            if location:
                named.param = ".".join([*location, named.param])
                message = f"{'.'.join(location)}.{message}"
            return error_response(400, message, named.param, "invalid_value")
    return error_response(400, f"{param or 'body'}: {message}", param, first.get("type"))
