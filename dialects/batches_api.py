"""OpenAI's Batch API (/v1/batches): its request, its objects, the check of an input file's lines,
and the lines of the output and error files.

An input file holds one request per line, ``{"custom_id": "…", "method": "POST", "url":
"/v1/chat/completions", "body": {…}}``; the file is checked before any line runs (``check_lines``)
for what OpenAI's validation refuses, a malformed file: a line that is not JSON, lacks
custom_id / method / url / body, repeats a custom_id, names another URL than the batch's endpoint,
or names another model than the lines before it. Such a file fails the whole batch with the
lines' errors, and no line runs. A line's body is the endpoint's to judge: each line's result is
one output line, ``{"id": "batch_req_…", "custom_id": "…", "response": {"status_code": 200,
"request_id": "…", "body": {…}}, "error": null}``: a 2xx answer goes to the output file, any other
answer (the endpoint refused the body: its 4xx body; a timeout) to the error file with its status
and body, and a line the batch never ran (cancelled, expired) to the error file with ``response``
null and ``error`` {code, message} (``batch_cancelled``, ``batch_expired``). Neither file promises
an order (OpenAI's neither): a line's result is found by its custom_id.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from dialects.errors import error_body

# The endpoints a batch may run.
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
ENDPOINTS = frozenset(get_args(Endpoint))
COMPLETION_WINDOW_S = 24 * 3600
MAX_METADATA_PAIRS = 16
# A line's body may not say these: batch lines are answered whole and run at the batch's priority.
# Such a line is refused on its own (its 400 in the error file), as the endpoint refuses a body.
REFUSED_BODY_FIELDS = {"stream": "batch lines are answered whole, not streamed",
                       "priority": "batch lines run at the batch priority (docs/api.md, \"Batches\")"}


class CreateBatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: StrictStr = Field(description="a file uploaded with purpose=batch")
    endpoint: Endpoint
    completion_window: Literal["24h"] = Field(description="the batch expires 24 hours after its creation")
    metadata: dict[StrictStr, StrictStr] | None = Field(None, description=f"at most {MAX_METADATA_PAIRS} pairs; "
                                                        "keys up to 64 characters, values up to 512")

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs")
        if any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
            raise ValueError("keys are at most 64 characters, values at most 512")
        return metadata


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def new_batch(create: CreateBatchRequest, batch_id: str | None = None, now: int | None = None) -> dict:
    """A batch as created: ``validating``, its lines not read yet."""
    now = int(time.time()) if now is None else now
    return {"id": batch_id or new_batch_id(), "object": "batch", "endpoint": create.endpoint, "errors": None,
            "input_file_id": create.input_file_id, "completion_window": create.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
            "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": create.metadata}


def line_error(line: int, code: str, message: str, param: str | None = None) -> dict:
    """One entry of a failed batch's ``errors.data``; ``line`` counts from 1, as OpenAI's do."""
    return {"code": code, "message": f"line {line}: {message}", "param": param, "line": line}


def check_lines(text: str, endpoint: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """The input's requests as (custom_id, body), in order, and the errors of the lines that do not
    validate: not JSON, no custom_id, one seen before, a method but POST, another endpoint, no body
    object, a model other than the first line's. Blank lines are skipped; their numbers still count."""
    requests: list[tuple[str, dict]] = []
    errors: list[dict] = []
    seen: set[str] = set()
    model: str | None = None  # the first line's; every line names it or none
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        error = _line_error(number, raw, endpoint, seen)
        item = json.loads(raw) if error is None else None
        named = item["body"].get("model") if item is not None else None
        if error is None and named is not None and model is not None and named != model:
            error = line_error(number, "mixed_models", f"body.model: {named!r}; a batch runs one model and its "
                                                       f"first line names {model!r}", "body.model")
        if error is not None:
            errors.append(error)
            continue
        model = model if model is not None else named
        seen.add(item["custom_id"])
        requests.append((item["custom_id"], item["body"]))
    if not requests and not errors:
        errors.append(line_error(1, "empty_file", "the input file holds no request"))
    return requests, errors


def _line_error(number: int, raw: str, endpoint: str, seen: set[str]) -> dict | None:
    try:
        item = json.loads(raw)
    except ValueError as error:
        return line_error(number, "invalid_json_line", f"not valid JSON ({error})")
    if not isinstance(item, dict):
        return line_error(number, "invalid_json_line", "not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return line_error(number, "missing_custom_id", "custom_id: a non-empty string is required", "custom_id")
    if custom_id in seen:
        return line_error(number, "duplicate_custom_id", f"custom_id: {custom_id!r} is used by an earlier line",
                          "custom_id")
    if item.get("method") != "POST":
        return line_error(number, "invalid_method", f"method: must be \"POST\", not {item.get('method')!r}", "method")
    url = item.get("url")
    if url != endpoint:
        known = "" if url in ENDPOINTS else " (not an endpoint a batch can run)"
        return line_error(number, "invalid_url", f"url: {url!r}{known}; this batch's endpoint is {endpoint}", "url")
    unknown = set(item) - {"custom_id", "method", "url", "body"}
    if unknown:
        return line_error(number, "invalid_request", f"{sorted(unknown)[0]}: not a field of a batch line",
                          sorted(unknown)[0])
    body = item.get("body")
    if not isinstance(body, dict):
        return line_error(number, "invalid_request", "body: a JSON object is required", "body")
    return None


def body_refusal(body: dict) -> dict | None:
    """The 400 body a line gets without being sent, for a field no batch line may carry (None: send it)."""
    for name, why in REFUSED_BODY_FIELDS.items():
        if body.get(name) not in (None, False):
            return error_body(400, f"{name}: not accepted in a batch line; {why}", name, "invalid_value")
    return None


def output_line(custom_id: str, status_code: int, body: dict, request_id: str | None = None) -> dict:
    """A line the endpoint answered (the output file for a 2xx, the error file otherwise)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id or uuid.uuid4().hex, "body": body},
            "error": None}


def unanswered_line(custom_id: str, code: str) -> dict:
    """A line the batch never ran: ``batch_cancelled`` or ``batch_expired`` (the error file)."""
    why = {"batch_cancelled": "the batch was cancelled before this request ran",
           "batch_expired": "this request could not be executed before the completion window expired"}[code]
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": why}}


def list_page(batches: list[dict], limit: int, has_more: bool) -> dict:
    """GET /v1/batches' answer: a cursor page, newest first (``after`` is the last id of the page before)."""
    return {"object": "list", "data": batches[:limit], "first_id": batches[0]["id"] if batches else None,
            "last_id": batches[:limit][-1]["id"] if batches else None, "has_more": has_more}
