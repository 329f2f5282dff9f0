"""The Files and Batch APIs' routes (/v1/files, /v1/batches) and what serves them in each ingress
replica: the store (deployments/ingress/batch_store.py), the runner draining batches
(deployments/ingress/batch_runner.py) and the per-key rate limiter (deployments/ingress/rate_limits.py).

``serve_batches`` sets them up in the ingress replica and starts the runner; the routes reach
them through ``request.app.state`` (they are plain FastAPI routes of the ingress's app, not methods
of the Ingress). The app it is given is the one the replica serves: Serve ships the ingress class
with a copy of the module's app, so ``deployments.ingress.http_app.app`` imported in the replica is
another object, whose state no route reads. Shapes and checks are the dialect's (dialects/files_api.py, dialects/batches_api.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
import time
from typing import Callable, Literal
import uuid

from fastapi import APIRouter, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
import httpx
from prometheus_client import Counter
from ray import serve

from deployments.ingress.batch_runner import BatchRunner
from deployments.ingress.batch_store import BatchStore
from deployments.config import AppArgs
from deployments.ingress.http_app import app as module_app
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress.rate_limits import RateLimiter
from dialects import batches_api, files_api
from dialects.batches_api import CreateBatchRequest
from dialects.errors import APIError, documented

router = APIRouter()
PROBE_TIMEOUT_S = 2.0
FORM_BYTES = 64 << 10  # a multipart upload's bytes around its file: boundaries, headers, the purpose field


@dataclass
class BatchService:
    store: BatchStore
    runner: BatchRunner
    upload_limits: files_api.UploadLimits
    task: asyncio.Task  # the runner's, held here: the event loop keeps only a weak reference to it


def serve_batches(app: FastAPI, args: AppArgs, engine_handles: dict, metrics: IngressMetrics,
                  interactive_running: Callable[[], bool]) -> RateLimiter:
    """Set up the store, the rate limiter and the runner in this ingress replica (``app.state`` of
    ``app``, the app the replica serves), and start the runner; returns the limiter.
    ``engine_handles``: the engine deployments whose queues pace the runner; ``interactive_running``:
    whether interactive requests run through this replica now (the runner sends no line then)."""
    app_name = serve.get_replica_context().app_name
    limiter = RateLimiter(args.rate_limits, app_name, metrics.registry)
    app.state.rate_limits = limiter
    app.state.max_upload_bytes = args.max_file_bytes + FORM_BYTES
    if app.state.api_key is not None and args.rate_limits.keys:  # the listed keys are API keys too
        app.state.api_key = [app.state.api_key, *args.rate_limits.api_keys()]
    store = BatchStore(Path(args.batch_dir).expanduser() / app_name)  # each app its own files and batches
    retries = Counter("pdserve_batch_line_retries", "batch lines sent again after a 429 or 503", ["status"],
                      registry=metrics.registry)
    runner = BatchRunner(store, in_process_sender(app, args.api_key.get_secret_value() if args.api_key else None),
                         engines_waiting(engine_handles), f"ingress-{uuid.uuid4().hex}", args.batch_max_in_flight,
                         args.batch_lease_s, on_retry=lambda status: retries.labels(str(status)).inc(),
                         busy=interactive_running)
    task = asyncio.get_running_loop().create_task(runner.run())
    app.state.batches = BatchService(store, runner, files_api.UploadLimits(args.max_file_bytes, args.max_batch_lines),
                                     task)
    return limiter


def in_process_sender(app: FastAPI, api_key: str | None):
    """A batch line sent to this replica's own app, in process: the route, validation, admission and
    limits a client's request meets, counted against the batch's key (``rate_key``, which no
    client can set), and marked a batch line (``batch_line``: its engine requests are background,
    engine/scheduler.py)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(endpoint: str, body: dict, key_name: str) -> tuple[int, dict, float | None]:
        async def as_key(scope, receive, send_):
            scope["state"] = {**scope.get("state", {}), "rate_key": key_name, "batch_line": True}
            await app(scope, receive, send_)

        transport = httpx.ASGITransport(app=as_key, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pdserve-batch", timeout=None) as client:
            response = await client.post(endpoint, json=body, headers=headers)
        retry_after = response.headers.get("retry-after")
        return response.status_code, response.json(), float(retry_after) if retry_after else None

    return send


def engines_waiting(handles: dict):
    """The foreground requests waiting in the engines now (one replica of each deployment asked): the
    batch's own lines wait there whenever an interactive request runs, and are not counted."""
    async def probe() -> int:
        try:
            stats = await asyncio.wait_for(asyncio.gather(*(h.stats.remote() for h in handles.values())),
                                           PROBE_TIMEOUT_S)
        except Exception:  # a busy or restarting engine: treated as a queue, so the batch backs off
            return 1
        return sum(sum(s.waiting_by_priority.values()) - s.waiting_background for s in stats)
    return probe


def service(request: Request) -> BatchService:
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


def _file(batches: BatchService, file_id: str) -> dict:
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


def _batch(batches: BatchService, batch_id: str) -> dict:
    doc = batches.store.batch(batch_id)
    if doc is None:
        raise APIError(404, f"batch_id: no batch {batch_id!r}", "batch_id", "batch_not_found")
    return doc


module_app.include_router(router)  # before Serve copies the app: the copy has these routes
