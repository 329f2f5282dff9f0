"""Error bodies in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayTaskError

TYPES = {400: "invalid_request_error", 404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
         503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def root_cause(error: BaseException) -> BaseException:
    """The exception a replica raised, without Ray's wrapper around it."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


def from_value_error(error: ValueError) -> APIError:
    """Engine and parameter checks say "<field>: <rule>"; the field becomes ``param``."""
    message = str(error)
    field, sep, _ = message.partition(":")
    param = field if sep and " " not in field else None
    return APIError(400, message, param, "invalid_value")


async def on_api_error(_: Request, error: APIError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code)


async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return error_response(400, "the body is not valid JSON", None, "invalid_json")
    if first.get("type") == "missing" and not location:
        return error_response(400, "the body is empty; a JSON object is required", None, "missing_body")
    return error_response(400, f"{param or 'body'}: {first.get('msg')}", param, first.get("type"))
