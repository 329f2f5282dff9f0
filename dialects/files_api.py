"""OpenAI's Files API (/v1/files): the objects it answers with and the checks of an upload.

A file is uploaded as multipart (``file``, ``purpose``); only ``purpose=batch`` is accepted (the
Batch API's input, JSONL; the route's schema says so); the server's own outputs carry
``purpose=batch_output``. The shapes
are OpenAI's API reference's, so the ``openai`` SDK's ``client.files.*`` reads them unchanged:

    {"id": "file-…", "object": "file", "bytes": 1234, "created_at": 1711471533,
     "filename": "requests.jsonl", "purpose": "batch", "status": "processed", "status_details": null,
     "expires_at": null}

A stored file is the plain dict of that shape (deployments/ingress/batch_store.py keeps it); nothing here
touches storage.
"""

from __future__ import annotations

from dataclasses import dataclass
import time
import uuid

from dialects.errors import APIError

OUTPUT_PURPOSE = "batch_output"
MAX_LIST_LIMIT = 10000  # OpenAI's bound on GET /v1/files?limit=
FORM_BYTES = 64 << 10  # a multipart upload's bytes around its file: boundaries, headers, the purpose field


@dataclass(frozen=True)
class UploadLimits:
    """The largest upload the server stores: ``max_bytes`` of file, ``max_lines`` JSONL lines."""

    max_bytes: int
    max_lines: int


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def file_object(file_id: str, filename: str, purpose: str, size: int, created_at: int | None = None) -> dict:
    """A file's object as OpenAI answers it."""
    return {"id": file_id, "object": "file", "bytes": size,
            "created_at": int(time.time()) if created_at is None else created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "status_details": None, "expires_at": None}


def check_upload(content: bytes, limits: UploadLimits) -> None:
    """Refuse (naming ``file``) an upload over the limits, not UTF-8, or empty; nothing is stored before."""
    if len(content) > limits.max_bytes:
        raise APIError(413, f"file: {len(content)} bytes; at most {limits.max_bytes} are accepted (max_file_bytes)",
                       "file", "file_too_large")
    if not content.strip():
        raise APIError(400, "file: is empty; a batch input holds one JSON request per line", "file", "empty_file")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"file: is not UTF-8 text (byte {error.start})", "file", "invalid_encoding") from None
    lines = sum(1 for line in text.splitlines() if line.strip())
    if lines > limits.max_lines:
        raise APIError(400, f"file: {lines} lines; at most {limits.max_lines} are accepted (max_batch_lines)",
                       "file", "too_many_lines")


def list_page(files: list[dict], limit: int, has_more: bool) -> dict:
    """GET /v1/files' answer: a cursor page (``after`` is the last id of the page before)."""
    page = files[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def deleted(file_id: str) -> dict:
    return {"id": file_id, "object": "file", "deleted": True}


def not_found(file_id: str, param: str = "file_id") -> APIError:
    return APIError(404, f"{param}: no file {file_id!r}", param, "file_not_found")
