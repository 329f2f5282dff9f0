"""What serves the Files and Batch APIs in each ingress replica: the store
(deployments/ingress/batch_store.py), the runner draining batches (deployments/ingress/batch_runner.py)
and the per-key rate limiter (deployments/ingress/rate_limits.py).

``serve_batches`` sets them up in the ingress replica and starts the runner; the routes
(dialects/batch_routes.py: plain FastAPI routes of the ingress's app) reach them through
``request.app.state.batches``. The app it is given is the one the replica serves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
import uuid

from fastapi import FastAPI
import httpx
from prometheus_client import Counter
from ray import serve

from deployments.ingress.batch_runner import BatchRunner
from deployments.ingress.batch_store import BatchStore
from deployments.config import AppArgs
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress.rate_limits import RateLimiter

PROBE_TIMEOUT_S = 2.0


@dataclass
class BatchService:
    store: BatchStore
    runner: BatchRunner
    upload_limits: object  # dialects/files_api.py's UploadLimits: the routes check an upload against them
    task: asyncio.Task  # the runner's, held here: the event loop keeps only a weak reference to it


def serve_batches(app: FastAPI, args: AppArgs, engine_handles: dict, metrics: IngressMetrics,
                  upload_limits: object, interactive_running: Callable[[], bool]) -> RateLimiter:
    """Set up the store, the rate limiter and the runner in this ingress replica (``app.state`` of
    ``app``, the app the replica serves), and start the runner; returns the limiter.
    ``engine_handles``: the engine deployments whose queues pace the runner; ``upload_limits``:
    what the routes accept of an upload (the binding module's, in the Files API's type);
    ``interactive_running``: whether interactive requests run through this replica now (the runner
    sends no line then)."""
    app_name = serve.get_replica_context().app_name
    limiter = RateLimiter(args.rate_limits, app_name, metrics.registry)
    app.state.rate_limits = limiter
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
    app.state.batches = BatchService(store, runner, upload_limits, task)
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
