"""The Files and Batch APIs and the per-key rate limits, served: the official openai SDK end to end
on the kept PD app (tests/serving.py: its small upload bounds, its listed keys, a 2 s batch lease).
tests/test_batch_lines.py checks the parts that need no server."""

import json

import httpx
import openai
import pytest

from tests.serving import (BATCH_LIMITS, assert_nothing_held, openai_apps, processes, sigkill, wait_until)

MODEL = "tiny-llama"
BATCH_KEY, OTHER_KEY = "sk-batch", "sk-other"
FINAL = ("completed", "failed", "cancelled", "expired")
POLL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def base_url():
    return f"{openai_apps()}/pd"


def sdk(base_url, key=BATCH_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)


def chat_line(i: int, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}, please."}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def upload(client: openai.OpenAI, lines: list) -> str:
    content = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return client.files.create(file=("input.jsonl", content.encode()), purpose="batch").id


def run_batch(client: openai.OpenAI, lines: list, endpoint="/v1/chat/completions"):
    return client.batches.create(input_file_id=upload(client, lines), endpoint=endpoint, completion_window="24h",
                                 metadata={"suite": "test_batch_api"})


def poll(base_url: str, batch_id: str, until, timeout_s: float = POLL_TIMEOUT_S) -> dict:
    """The batch once ``until(batch)`` holds; tolerates an ingress that is restarting (no answer, 5xx)."""
    seen = {}

    def reached() -> bool:
        try:
            response = httpx.get(f"{base_url}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {BATCH_KEY}"},
                                 timeout=10)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        seen.update(response.json())
        return until(seen)

    assert wait_until(reached, timeout_s, 0.2), f"batch not there after {timeout_s} s: {seen}"
    return dict(seen)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_files_through_the_openai_sdk(base_url):
    client = sdk(base_url)
    content = json.dumps(chat_line(1)) + "\n"
    created = client.files.create(file=("mine.jsonl", content.encode()), purpose="batch")
    assert (created.filename, created.purpose, created.bytes, created.object) == ("mine.jsonl", "batch",
                                                                                  len(content), "file")
    assert client.files.retrieve(created.id).id == created.id
    assert created.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(created.id).text == content
    assert client.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    paths = httpx.get(f"{base_url}/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/files", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}/cancel"} <= set(paths)


@pytest.mark.parametrize("content, purpose, status, param", [
    (b"x" * (BATCH_LIMITS["max_file_bytes"] + 1), "batch", 413, "file"),
    (b"{}\n" * (BATCH_LIMITS["max_batch_lines"] + 1), "batch", 400, "file"),
    (b"{}\n", "fine-tune", 400, "purpose"),
])
def test_an_upload_out_of_bounds_is_refused_by_name_and_not_stored(base_url, content, purpose, status, param):
    client = sdk(base_url)
    before = {f.id for f in client.files.list()}
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("big.jsonl", content), purpose=purpose)
    assert refused.value.status_code == status
    assert refused.value.body["param"] == param
    assert {f.id for f in client.files.list()} == before


def test_batch_output_equals_the_same_requests_one_by_one(base_url):
    """Through PD at temperature 0: each line's answer is the one the route gives the same body; a
    body the route refuses (over the served cap, out of the schema's range, asking to stream) is
    that line's 400 in the error file, and the batch completes with the others."""
    client = sdk(base_url)
    refused_lines = [chat_line(97, max_tokens=100000), chat_line(98, temperature=9), chat_line(99, stream=True)]
    lines = [chat_line(i) for i in range(4)] + refused_lines
    batch = run_batch(client, lines)
    assert batch.status == "validating" and batch.metadata == {"suite": "test_batch_api"}
    done = poll(base_url, batch.id, lambda b: b["status"] in FINAL)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 7, "completed": 4, "failed": 3}
    assert all(done[f] for f in ("in_progress_at", "finalizing_at", "completed_at"))

    outputs = {o["custom_id"]: o for o in output_lines(client, done["output_file_id"])}
    assert sorted(outputs) == [f"req-{i}" for i in range(4)]
    for line in lines[:4]:
        direct = client.chat.completions.create(**line["body"])
        answer = outputs[line["custom_id"]]["response"]
        assert answer["status_code"] == 200 and outputs[line["custom_id"]]["error"] is None
        assert answer["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert answer["body"]["choices"][0]["finish_reason"] == direct.choices[0].finish_reason
        assert (answer["body"]["usage"]["prompt_tokens"], answer["body"]["usage"]["completion_tokens"]) == (
            direct.usage.prompt_tokens, direct.usage.completion_tokens)
    refused = {r["custom_id"]: r["response"] for r in output_lines(client, done["error_file_id"])}
    assert {cid: (r["status_code"], r["body"]["error"]["param"]) for cid, r in refused.items()} == {
        "req-97": (400, "max_tokens"), "req-98": (400, "temperature"), "req-99": (400, "stream")}

    with pytest.raises(openai.ConflictError):  # a batch that has ended stays as it ended
        client.batches.cancel(batch.id)
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    assert client.batches.retrieve(batch.id).output_file_id == done["output_file_id"]
    # the lines were counted against the key that created the batch
    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'pdserve_rate_limit_window{key="batch-key",kind="requests"}' in metrics


def test_an_embeddings_batch(base_url):
    client = sdk(base_url)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": f"text {i}"}}
             for i in range(2)]
    done = poll(base_url, run_batch(client, lines, "/v1/embeddings").id, lambda b: b["status"] in FINAL)
    outputs = {o["custom_id"]: o["response"]["body"] for o in output_lines(client, done["output_file_id"])}
    direct = client.embeddings.create(model="all-MiniLM-L6-v2", input="text 1", encoding_format="float")
    assert outputs["e1"]["data"][0]["embedding"] == pytest.approx(direct.data[0].embedding, abs=1e-6)


def test_a_batch_with_an_invalid_line_fails_naming_it_and_runs_nothing(base_url):
    client = sdk(base_url)
    other_model = {**chat_line(4), "body": {**chat_line(4)["body"], "model": "another-model"}}
    lines = [chat_line(1), "{not json", chat_line(1), {**chat_line(3), "url": "/v1/completions"}, other_model]
    done = poll(base_url, run_batch(client, lines).id, lambda b: b["status"] in FINAL)
    assert done["status"] == "failed" and done["failed_at"]
    assert [(e["line"], e["code"]) for e in done["errors"]["data"]] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_url"), (5, "mixed_models")]
    assert done["request_counts"]["total"] == 0 and done["output_file_id"] is None


def test_a_batch_of_a_missing_file_is_refused(base_url):
    with pytest.raises(openai.NotFoundError) as refused:
        sdk(base_url).batches.create(input_file_id="file-none", endpoint="/v1/chat/completions",
                                     completion_window="24h")
    assert refused.value.body["param"] == "input_file_id"


def each_line_once(client, done: dict, total: int) -> tuple[list[dict], list[dict]]:
    outputs, errors = output_lines(client, done["output_file_id"]), output_lines(client, done["error_file_id"])
    ids = [o["custom_id"] for o in outputs + errors]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(total)), "a line lost or answered twice"
    return outputs, errors


@pytest.mark.slow
def test_cancel_mid_batch_writes_what_finished_and_frees_the_rest(base_url):
    client = sdk(base_url)
    total = 24
    batch = run_batch(client, [chat_line(i, max_tokens=48, ignore_eos=True) for i in range(total)])
    running = poll(base_url, batch.id, lambda b: b["request_counts"]["completed"] >= 1)
    assert running["request_counts"]["completed"] < total, "the batch ended before it could be cancelled"
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = poll(base_url, batch.id, lambda b: b["status"] in FINAL)
    assert done["status"] == "cancelled" and done["cancelled_at"]
    outputs, errors = each_line_once(client, done, total)
    assert outputs and all(o["response"]["status_code"] == 200 for o in outputs)
    assert any(e["error"] and e["error"]["code"] == "batch_cancelled" for e in errors)
    assert done["request_counts"] == {"total": total, "completed": len(outputs), "failed": len(errors)}
    assert_nothing_held(["PrefillServer", "DecodeServer"], "openai-pd")
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


@pytest.mark.slow
def test_a_restarted_ingress_resumes_the_batch_with_no_line_lost_or_twice(base_url):
    """The ingress replica is killed mid-batch; Serve starts another, whose runner reads the batch
    back from the store once the dead one's lease has run out."""
    client = sdk(base_url)
    total = 24
    batch = run_batch(client, [chat_line(i, max_tokens=48, ignore_eos=True) for i in range(total)])
    running = poll(base_url, batch.id, lambda b: b["request_counts"]["completed"] >= 1)
    (ingress,) = processes("Ingress", "openai-pd")
    sigkill(ingress)
    assert running["request_counts"]["completed"] < total, "the batch ended before the restart"
    done = poll(base_url, batch.id, lambda b: b["status"] in FINAL)
    assert done["status"] == "completed", done
    outputs, errors = each_line_once(sdk(base_url), done, total)
    assert len(outputs) == total and errors == []
    assert done["request_counts"] == {"total": total, "completed": total, "failed": 0}
    assert_nothing_held(["PrefillServer", "DecodeServer"], "openai-pd")


def chat(base_url: str, key: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Say something long."}],
                            "max_tokens": 4})


def test_a_key_past_its_requests_per_minute_gets_429_and_another_key_does_not(base_url):
    assert [chat(base_url, "sk-two").status_code for _ in range(2)] == [200, 200]
    refused = chat(base_url, "sk-two")
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "rpm" in error["message"]
    assert chat(base_url, OTHER_KEY).status_code == 200
    assert chat(base_url, "no-listed-key").status_code == 200  # the default budget: unlimited here
    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'pdserve_rate_limited_requests_total{key="two-a-minute",limit="rpm"} 1.0' in metrics
    assert 'pdserve_rate_limit{key="two-a-minute",kind="rpm"} 2.0' in metrics


def test_a_key_past_its_tokens_per_minute_gets_429_in_the_route_dialect(base_url):
    assert chat(base_url, "sk-few").status_code == 200  # admitted under the budget; its tokens exceed it
    assert wait_until(lambda: chat(base_url, "sk-few").status_code == 429, 10)  # the charge lands
    refused = httpx.post(f"{base_url}/v1/messages", headers={"x-api-key": "sk-few"}, timeout=60,
                         json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert refused.json()["error"]["type"] == "rate_limit_error" and "tpm" in refused.json()["error"]["message"]
    # MindIE's route carries err_msg beside OpenAI's object; Databricks' answers in its own shape.
    refused = httpx.post(f"{base_url}/infer_token", headers={"Authorization": "Bearer sk-few"}, timeout=60,
                         json={"input_id": [1, 5, 9], "parameters": {"max_new_tokens": 2}})
    assert refused.status_code == 429 and "tpm" in refused.json()["details"]["err_msg"]
    assert refused.json()["generated_text"] == "" and refused.json()["error"]["code"] == "rate_limit_exceeded"
    refused = httpx.post(f"{base_url}/serving-endpoints/{MODEL}/invocations", timeout=60,
                         headers={"Authorization": "Bearer sk-few"}, json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert refused.json()["error_code"] == "REQUEST_LIMIT_EXCEEDED" and "tpm" in refused.json()["message"]


def test_a_body_too_large_for_infer_token_carries_err_msg(base_url):
    refused = httpx.post(f"{base_url}/infer_token", timeout=60,
                         json={"input_id": [5] * (1 << 21), "parameters": {"max_new_tokens": 2}})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "body_too_large"
    assert refused.json()["details"]["err_msg"] == refused.json()["error"]["message"]
