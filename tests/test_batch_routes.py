"""The Files and Batch routes in process, through the openai SDK over an ASGI transport: the
app's own routes, middleware (the upload bound) and store, and the runner's checking and
cancelling, without Ray (quick, and independent of the served tests' start-up). What needs the
engines, lines answered, a restart, the limits' 429s, is tests/test_batch_api.py's, served."""

import asyncio
import json

import httpx
import openai
import pytest

from deployments.ingress.batch_service import BatchService
from deployments.ingress.batch_runner import BatchRunner
from deployments.ingress.batch_store import BatchStore
from deployments.ingress.ingress import Ingress, build_app
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress.rate_limits import RateLimiter, RateLimits
from dialects.files_api import FORM_BYTES, UploadLimits

MAX_BYTES, MAX_LINES = 2000, 3
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


async def no_queue() -> int:
    return 0


async def never_sent(endpoint, body, key_name):
    raise AssertionError("no line of these batches runs")


@pytest.fixture
def app(tmp_path):
    """A replica's app in process (every route registered, as in a replica; only the Files and Batch
    routes are called, so the Ingress behind them is never built), its batch state under ``tmp_path``."""
    app = build_app(object.__new__(Ingress.func_or_class))
    app.state.metrics, app.state.max_body_bytes, app.state.api_key = IngressMetrics(), 1 << 20, None
    app.state.max_upload_bytes = MAX_BYTES + FORM_BYTES
    app.state.rate_limits = RateLimiter(RateLimits(), "in-process", app.state.metrics.registry)  # no limits: no actor
    store = BatchStore(tmp_path)
    app.state.batches = BatchService(store, BatchRunner(store, never_sent, no_queue, "me", 1, 2.0),
                                     UploadLimits(MAX_BYTES, MAX_LINES), None)
    return app


@pytest.fixture
def client(app):
    """An SDK client of ``app``."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")
    return openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", max_retries=0, http_client=http)


def run(coroutine):
    return asyncio.run(coroutine)


def test_files_round_trip(client):
    async def go():
        content = (json.dumps(LINE) + "\n").encode()
        created = await client.files.create(file=("in.jsonl", content), purpose="batch")
        assert (created.bytes, created.purpose, created.filename) == (len(content), "batch", "in.jsonl")
        assert (await client.files.retrieve(created.id)).id == created.id
        assert [f.id for f in (await client.files.list()).data] == [created.id]
        assert (await client.files.content(created.id)).content == content
        assert (await client.files.delete(created.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.content(created.id)
    run(go())


@pytest.mark.parametrize("content, purpose, status, param", [
    (b"x" * (MAX_BYTES + 1), "batch", 413, "file"),
    (b"x" * (MAX_BYTES + FORM_BYTES), "batch", 413, None),  # the body's bound, before it is read
    (b"{}\n" * (MAX_LINES + 1), "batch", 400, "file"),
    (b"{}\n", "fine-tune", 400, "purpose"),
])
def test_an_upload_out_of_bounds_is_refused_and_not_stored(client, content, purpose, status, param):
    async def go():
        with pytest.raises(openai.APIStatusError) as refused:
            await client.files.create(file=("in.jsonl", content), purpose=purpose)
        assert (refused.value.status_code, refused.value.body["param"]) == (status, param)
        assert (await client.files.list()).data == []
    run(go())


def test_an_invalid_input_fails_the_batch_and_a_cancelled_one_ends_cancelled(client, app):
    async def go():
        runner = app.state.batches.runner
        bad = await client.files.create(file=("bad.jsonl", b"{nope\n" + json.dumps(LINE).encode()), purpose="batch")
        failed = await client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                                             completion_window="24h", metadata={"k": "v"})
        assert failed.status == "validating" and failed.metadata == {"k": "v"}
        await runner.drive(failed.id)
        failed = await client.batches.retrieve(failed.id)
        assert failed.status == "failed"
        assert [(e.line, e.code) for e in failed.errors.data] == [(1, "invalid_json_line")]

        good = await client.files.create(file=("in.jsonl", json.dumps(LINE).encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        assert (await client.batches.cancel(batch.id)).status == "cancelling"
        await runner.drive(batch.id)
        assert (await client.batches.retrieve(batch.id)).status == "cancelled"
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(failed.id)
        page = await client.batches.list(limit=1)
        assert page.has_more and [b.id for b in page.data] == [batch.id]
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-none", endpoint="/v1/chat/completions",
                                        completion_window="24h")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.create(input_file_id=good.id, endpoint="/v1/moderations", completion_window="24h")
        assert refused.value.body["param"] == "endpoint"
    run(go())
