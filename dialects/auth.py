"""The API key (AppArgs.api_key, else the environment's PDSERVE_API_KEY, as vLLM's --api-key and
VLLM_API_KEY): when set, every model route needs ``Authorization: Bearer <key>``; Anthropic's
routes also take it as ``x-api-key`` (its SDK's header). Operations stay open: /health, /metrics,
/openapi.json, /docs and the page at / (it asks for the key itself). docs/api.md has the decisions."""

from __future__ import annotations

import hmac
from typing import Mapping

from dialects.errors import APIError

OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/openapi.json", "/docs"})


def route_path(scope: Mapping) -> str:
    """The request's path below the app's route prefix (Serve's /pd, /co, ...)."""
    path, prefix = scope.get("path", ""), scope.get("root_path", "")
    return path[len(prefix):] if prefix and path.startswith(prefix) else path


def is_open(path: str) -> bool:
    """Whether ``path`` (below the route prefix) is served without the key."""
    return (path or "/") in OPEN_PATHS  # "": the route prefix itself (/pd)


def check_api_key(api_key: str | list[str] | None, headers: Mapping[str, str], x_api_key: bool = False) -> None:
    """A 401 unless the request carries ``api_key`` (or one of them; none needed when it is None).
    ``x_api_key``: the route also takes it in Anthropic's header. Compared in constant time."""
    if api_key is None:
        return
    keys = [api_key] if isinstance(api_key, str) else api_key
    authorization = headers.get("authorization") or ""
    scheme, _, given = authorization.partition(" ")
    candidates = [given.strip()] if scheme.lower() == "bearer" else []
    if x_api_key and headers.get("x-api-key") is not None:
        candidates.append(headers["x-api-key"])
    if not any(hmac.compare_digest(c.encode(), key.encode()) for c in candidates for key in keys):
        where = "'Authorization: Bearer <key>'" + (" or 'x-api-key: <key>'" if x_api_key else "")
        raise APIError(401, f"a valid API key is required: send {where}", None, "invalid_api_key")
