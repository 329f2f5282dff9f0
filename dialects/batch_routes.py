"""The Files and Batch APIs' routes (/v1/files, /v1/batches): OpenAI's shapes and checks
(files_api.py, batches_api.py) over the ingress replica's batch service, which each route finds at
``request.app.state.batches``: its ``store`` (deployments/ingress/batch_store.py's BatchStore:
files, batches and their lines) and its ``upload_limits``; the runner that drains the batches is
the service's too (deployments/ingress/batch_service.py). Plain FastAPI routes of the ingress's app,
included by the module that builds it (deployments/ingress/ingress.py ``build_app``); nothing here
knows Ray.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from dialects import batches_api, files_api
from dialects.batches_api import CreateBatchRequest
from dialects.errors import APIError, documented

router = APIRouter()


def service(request: Request):
    """The replica's batch service (``app.state.batches``), or a 503 while it is not set up."""
    batches = getattr(request.app.state, "batches", None)
    if batches is None:
        raise APIError(503, "the Files and Batch APIs are not ready", code="not_ready")
    return batches


# ---- /v1/files ------------------------------------------------------------------------

@router.post("/v1/files", responses=documented(400, 413, 503))
async def upload_file(request: Request, file: UploadFile = File(...),
                      purpose: Literal["batch"] = Form(..., description="the Batch API's input; the only purpose "
                                                       "kept here")):
    """A batch input (JSONL), checked against the size and line limits before it is stored."""
    batches = service(request)
    if file.size is not None and file.size > batches.upload_limits.max_bytes:
        raise APIError(413, f"file: {file.size} bytes; at most {batches.upload_limits.max_bytes} are accepted "
                       "(max_file_bytes)", "file", "file_too_large")
    content = await file.read()
    files_api.check_upload(content, batches.upload_limits)
    doc = files_api.file_object(files_api.new_file_id(), file.filename or "upload.jsonl", purpose, len(content))
    return batches.store.add_file(doc, content)


@router.get("/v1/files", responses=documented(400, 503))
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(files_api.MAX_LIST_LIMIT, ge=1, le=files_api.MAX_LIST_LIMIT),
                     order: Literal["asc", "desc"] = "desc"):
    files, has_more = service(request).store.files(purpose, after, limit, order == "desc")
    return files_api.list_page(files, limit, has_more)


@router.get("/v1/files/{file_id}", responses=documented(404, 503))
async def get_file(request: Request, file_id: str):
    return _file(service(request), file_id)


@router.get("/v1/files/{file_id}/content", responses={200: {"content": {"application/octet-stream": {}}},
                                                      **documented(404, 503)})
async def file_content(request: Request, file_id: str):
    batches = service(request)
    _file(batches, file_id)
    return Response(batches.store.content(file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=documented(404, 503))
async def delete_file(request: Request, file_id: str):
    if not service(request).store.delete_file(file_id):
        raise files_api.not_found(file_id)
    return files_api.deleted(file_id)


def _file(batches, file_id: str) -> dict:
    doc = batches.store.file(file_id)
    if doc is None:
        raise files_api.not_found(file_id)
    return doc


# ---- /v1/batches ----------------------------------------------------------------------

@router.post("/v1/batches", responses=documented(400, 404, 503))
async def create_batch(request: Request, body: CreateBatchRequest):
    """A batch of the input file's lines, ``validating`` until the runner has checked them."""
    batches = service(request)
    input_file = batches.store.file(body.input_file_id)
    if input_file is None:
        raise files_api.not_found(body.input_file_id, "input_file_id")
    if input_file["purpose"] != "batch":
        raise APIError(400, f"input_file_id: {body.input_file_id!r} has purpose {input_file['purpose']!r}; a batch "
                       "reads a file uploaded with purpose=batch", "input_file_id", "invalid_value")
    # the key whose budget its lines use: the one the request came with (deployments/ingress/rate_limits.py)
    return batches.store.add_batch(batches_api.new_batch(body), request.state.rate_key)


@router.get("/v1/batches", responses=documented(400, 503))
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    page, has_more = service(request).store.batches(after, limit)
    return batches_api.list_page(page, limit, has_more)


@router.get("/v1/batches/{batch_id}", responses=documented(404, 503))
async def get_batch(request: Request, batch_id: str):
    return _batch(service(request), batch_id)


@router.post("/v1/batches/{batch_id}/cancel", responses=documented(404, 409, 503))
async def cancel_batch(request: Request, batch_id: str):
    """``cancelling`` at once; ``cancelled`` when the runner has cancelled the lines in flight and
    written what finished."""
    batches = service(request)
    batch = _batch(batches, batch_id)
    cancelled = batches.store.update(batch_id, ("validating", "in_progress"), status="cancelling",
                                     cancelling_at=int(time.time()))
    if cancelled is None and batch["status"] not in ("cancelling", "cancelled"):
        raise APIError(409, f"batch_id: the batch is {batch['status']}; only a validating or in_progress batch can "
                       "be cancelled", "batch_id", "batch_not_cancellable")
    return cancelled or batches.store.batch(batch_id)


def _batch(batches, batch_id: str) -> dict:
    doc = batches.store.batch(batch_id)
    if doc is None:
        raise APIError(404, f"batch_id: no batch {batch_id!r}", "batch_id", "batch_not_found")
    return doc

