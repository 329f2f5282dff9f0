"""Error bodies in OpenAI's shape: {"error": {"message", "type", "param", "code"}}; the dialects'
error type (``APIError``) and FastAPI's own errors (validation, unknown routes) in that shape.
What a client is told of a replica's failure is the serving room's mapping
(deployments/ingress/engine_client.py ``client_error``), which answers with an ``APIError``."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
         409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable_error", 504: "timeout_error"}


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


def from_value_error(error: ValueError) -> APIError:
    """Engine and parameter checks say "<field>: <rule>"; the field becomes ``param``."""
    message = str(error)
    field, sep, _ = message.partition(":")
    param = field if sep and " " not in field else None
    return APIError(400, message, param, "invalid_value")


async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (a body that cannot be parsed, an unknown route or method) in OpenAI's shape."""
    code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    response = error_response(error.status_code, str(error.detail), None, code)
    response.headers.update(error.headers or {})
    if error.status_code == 405:  # Starlette's Allow names the first route of the path; a path can have several
        response.headers["Allow"] = ", ".join(allowed_methods(request))
    return response


def allowed_methods(request: Request) -> list[str]:
    """Every method a route of the request's path takes (POST /v1/files and GET /v1/files are two routes)."""
    return sorted({method for route in request.app.routes if getattr(route, "methods", None)
                   and route.matches(request.scope)[0] is not Match.NONE for method in route.methods})


async def on_api_error(_: Request, error: APIError) -> JSONResponse:
    return error.response()


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
            where = ".".join(location)
            # A check may already name its field from the top (response_format.json_schema): no second prefix.
            if where and named.param != where and not named.param.startswith(where + "."):
                named.param = f"{where}.{named.param}"
                message = f"{where}.{message}"
            return error_response(400, message, named.param, "invalid_value")
    return error_response(400, f"{param or 'body'}: {message}", param, first.get("type"))
