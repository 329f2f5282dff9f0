"""Databricks' Foundation Model API (seeds/002): ``POST /serving-endpoints/{name}/invocations``.

The endpoint's ``{name}`` names the model; the body names none (``model`` is optional, and refused
when it names another model than the endpoint). The body's shape picks the task: ``messages`` →
chat, ``prompt`` → completions, ``input`` → embeddings; each is then the OpenAI request the seed
lists the fields of (dialects/openai_schema.py carries Databricks' own: ``use_raw_prompt``,
``error_behavior``, ``instruction``, top_p 0), served by the OpenAI routes' bodies
(dialects/openai_serving.py) and answered in their shapes, which seeds/002 copies. Errors take
Databricks' REST shape ``{"error_code", "message"}``. docs/api.md has the decisions.
"""

from __future__ import annotations

import json
from typing import Callable

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from dialects.engine_client import Origin
from dialects.errors import APIError
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from dialects.openai_serving import OpenAIServing

ROUTE_PREFIX, ROUTE_SUFFIX = "/serving-endpoints/", "/invocations"
# The body's field that says its task (seeds/002: each task's one required field), and its request.
TASKS: dict[str, type[BaseModel]] = {"messages": ChatCompletionRequest, "prompt": CompletionRequest,
                                     "input": EmbeddingRequest}
# Databricks' REST error codes by status (its REST API's error responses).
ERROR_CODES = {400: "INVALID_PARAMETER_VALUE", 401: "UNAUTHENTICATED", 404: "RESOURCE_DOES_NOT_EXIST",
               405: "BAD_REQUEST", 408: "DEADLINE_EXCEEDED", 413: "BAD_REQUEST", 429: "REQUEST_LIMIT_EXCEEDED",
               503: "TEMPORARILY_UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def is_route(path: str) -> bool:
    return path.startswith(ROUTE_PREFIX) and path.endswith(ROUTE_SUFFIX)


def from_openai_error(response: JSONResponse) -> JSONResponse:
    """An error response in OpenAI's shape (the server's handlers make them) in Databricks', with its
    status and headers (Retry-After, WWW-Authenticate)."""
    message = json.loads(response.body)["error"]["message"]
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse({"error_code": ERROR_CODES.get(response.status_code, "INTERNAL_ERROR"), "message": message},
                        status_code=response.status_code, headers=headers)


def task_of(body: dict) -> str:
    """The body's task field: exactly one of ``TASKS``; a 400 naming them otherwise."""
    named = [field for field in TASKS if field in body]
    if len(named) != 1:
        found = f"it has {', '.join(named)}" if named else "it has none"
        raise APIError(400, "body: an invocation has exactly one of 'messages' (chat), 'prompt' (completions) "
                            f"or 'input' (embeddings); {found}", None, "invalid_value")
    return named[0]


def parsed(body: dict, task: str, endpoint: str) -> BaseModel:
    """``body`` as its task's request, ``model`` the endpoint's; its own ``model``, when given, must
    be the endpoint's (a 400 naming the field). Schema failures are the route's validation errors."""
    given = body.get("model")
    if given is not None and given != endpoint:
        raise APIError(400, f"model: {given!r} is not this endpoint's model ({endpoint!r}); leave it out or "
                            "name the endpoint's", "model", "invalid_value")
    try:
        return TASKS[task].model_validate({**body, "model": endpoint})
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


class DatabricksServing:
    """The invocations route of one ingress replica, over the OpenAI routes' bodies."""

    def __init__(self, openai: OpenAIServing) -> None:
        self.openai = openai

    async def endpoints(self, task: str) -> list[str]:
        """The endpoint names a task answers on: the embedder's for embeddings; the model's, its
        aliases and its LoRA adapters for chat and completions."""
        if task == "input":
            name = await self.openai.client.embedding_model()
            return [name] if name is not None else []
        front = await self.openai.frontend()
        return [front.served_model_name, *sorted(front.aliases), *front.adapters]

    async def invoke(self, endpoint: str, body: dict, origin: Callable[[int], Origin]):
        """Serve one invocation. ``origin``: the request's origin for its priority (the ingress's)."""
        task = task_of(body)
        served = await self.endpoints(task)
        if endpoint not in served:
            kind = "embeddings" if task == "input" else "chat and completions"
            names = ", ".join(repr(n) for n in served) or "none"
            raise APIError(404, f"endpoint {endpoint!r} does not exist; {kind} are served at: {names}", "name",
                           "endpoint_not_found")
        request = parsed(body, task, endpoint)
        if task == "input":
            return await self.openai.embeddings(request)
        return await self.openai.generate(request, origin(request.priority), chat=task == "messages")
