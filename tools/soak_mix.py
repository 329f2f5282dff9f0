"""The soak's requests: a seeded pool of legitimate requests in both dialects, hostile inputs, and
the client that sends one and records everything the invariants need (tools/soak_invariants.py).

Every legitimate request is greedy or seeded sampling in float32 on a batch-invariant app, so a
fault-free run of it gives one exact answer (its reference, taken before any fault). ``pool``
mixes the features the default app serves: completions and chat, streamed or not, ``n``,
logprobs, stop strings, structured output (JSON schema, a choice), tools, priorities 1..5,
deadlines, MindIE beams, draft tokens, prompt lookup, stop words, long prompts (prefilled on P)
and short ones (on D). LoRA is not served by the default app: an unknown adapter is a hostile
input here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import json
import random
import time

import httpx

MODEL = "tiny-llama"
CLIENT_TIMEOUT_S = 120  # a request with no answer by then is lost (a hang)
LONG_PROMPT = 700  # tokens: past pd_local_prefill_tokens (256), so P computes it; its KV (> 100 KiB) goes
# through Ray's object store, not inline
OVERSIZE_BYTES = 5 << 20  # past the app's max_body_bytes (4 MiB): a 413
REFERENCE_TRIES = 30  # a reference answered 503 (not ready) is asked again, a second apart
DRIP_CHUNKS, DRIP_GAP_S = 8, 0.25  # a slow-drip body: 2 s, bounded


@dataclass(frozen=True)
class Work:
    """One request to send. ``deadline``: its ``timeout`` may end it early (a prefix of its reference is
    then right). ``hostile``: the kind of bad input, answered 4xx."""

    name: str
    path: str
    body: dict | bytes | None
    stream: bool = False
    deadline: bool = False
    hostile: str | None = None


@dataclass
class Record:
    """What a client saw of one request. ``texts``: per choice, what it delivered (tool calls rendered
    after the content as ``<name>arguments``); ``terminals``: end markers seen ([DONE], MindIE's last
    event, a whole JSON answer); ``after_terminal``: events read after the end marker."""

    work: Work
    sent_at: float
    ended_at: float = 0.0
    status: int | None = None
    ttft_s: float | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    event_times: list[float] = field(default_factory=list)  # monotonic, each streamed event's arrival
    terminals: int = 0
    after_terminal: int = 0
    error: str | None = None  # a clean error's message (HTTP body or in-band)
    error_code: str | None = None
    error_body: str = ""  # every error text the client saw, for the raw-internals check
    disconnected: bool = False  # the client left on purpose
    failure: str | None = None  # transport failure not chosen by the client (reset, hang)


def _completion(i: int, priority: int, **extra) -> dict:
    return {"model": MODEL, "prompt": f"soak request {i}: once upon a time", "max_tokens": 32,
            "temperature": 0, "priority": priority, **extra}


def _chat(i: int, priority: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"soak chat {i}, tell me more"}],
            "max_tokens": 32, "temperature": 0, "priority": priority, **extra}


def _infer(i: int, priority: int, tokens: int = 32, prompt: list[int] | None = None, **parameters) -> dict:
    return {"input_id": prompt or [1, 30 + i, 31 + i, 32], "parameters": {
        "max_new_tokens": tokens, "do_sample": False, "details": True, "priority": priority, **parameters}}


def _long_prompt(i: int) -> list[int]:
    return [1] + [(13 * i + 7 * j) % 700 + 3 for j in range(LONG_PROMPT)]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
SAMPLED = {"temperature": 0.8, "top_k": 40}


def pool(variants: int = 2) -> list[Work]:
    """The legitimate requests, ``variants`` of each feature (own prompts): every one has one answer."""
    out = []
    for v in range(variants):
        p = 1 + v % 5
        out += [
            Work("completion greedy stream", "/v1/completions", _completion(v, p), stream=True),
            Work("completion n=2 seeded logprobs", "/v1/completions",
                 _completion(10 + v, p + 1, n=2, logprobs=2, seed=100 + v, **SAMPLED)),
            Work("completion stop string", "/v1/completions", _completion(20 + v, 3, stop=["e"], max_tokens=48),
                 stream=True),
            Work("completion choice", "/v1/completions",
                 _completion(30 + v, 4, structured_outputs={"choice": ["yes", "no", "maybe"]})),
            Work("completion long prompt (P)", "/v1/completions",
                 _completion(40 + v, 2, prompt=_long_prompt(v), ignore_eos=True), stream=True),
            Work("completion deadline 1 s", "/v1/completions",
                 _completion(50 + v, 5, max_tokens=160, ignore_eos=True, timeout=1), stream=True, deadline=True),
            Work("chat greedy stream", "/v1/chat/completions", _chat(v, p, logprobs=True, top_logprobs=2), stream=True),
            Work("chat tools required", "/v1/chat/completions",
                 _chat(10 + v, 2, tools=[TOOL], tool_choice="required", max_tokens=96)),
            Work("chat json schema", "/v1/chat/completions", _chat(20 + v, 1, response_format=SCHEMA, max_tokens=64),
                 stream=True),
            Work("chat seeded n=2", "/v1/chat/completions", _chat(30 + v, 4, n=2, seed=200 + v, **SAMPLED)),
            Work("infer greedy stream", "/infer_token", _infer(v, p), stream=True),
            Work("infer seeded logprobs", "/infer_token",
                 _infer(10 + v, 3, do_sample=True, seed=300 + v, top_k=40, temperature=0.8,
                        return_log_probs=True, top_log_probs=2), stream=True),
            Work("infer beams", "/infer_token", _infer(20 + v, 2, tokens=16, beam_width=2)),
            Work("infer draft tokens", "/infer_token", _infer(30 + v, 1, draft_input_ids=[322, 263, 243, 29]),
                 stream=True),
            Work("infer prompt lookup, stop words", "/infer_token",
                 _infer(40 + v, 5, prompt_lookup=True, stop_words=[[29]])),
            Work("infer long prompt (P)", "/infer_token", _infer(50 + v, 3, prompt=_long_prompt(10 + v)), stream=True),
        ]
    return out


def hostile() -> list[Work]:
    """Bad inputs, each answered 4xx naming what is wrong, never 5xx, never Ray's internals."""
    completion = _completion(0, 5)
    bad_grammar = {**completion, "structured_outputs": {"regex": "(unclosed"}}
    bad_schema = _chat(0, 5, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}})
    return [replace(work, hostile=work.name) for work in [
        Work("malformed JSON", "/v1/completions", b'{"model": "tiny-llama", "prompt": "x", '),
        Work("malformed JSON (MindIE)", "/infer_token", b'{"input_id": [1, 2,'),
        Work("wrong types", "/v1/chat/completions", {**_chat(0, 5), "max_tokens": "ten", "n": [2]}),
        Work("wrong types (MindIE)", "/infer_token", {"input_id": "1 2 3", "parameters": {"max_new_tokens": 4}}),
        Work("oversize body", "/v1/completions", {**completion, "prompt": "a" * OVERSIZE_BYTES}),
        Work("huge n", "/v1/completions", {**completion, "n": 10**6}),
        Work("huge max_tokens", "/v1/completions", {**completion, "max_tokens": 10**9}),
        Work("invalid grammar", "/v1/completions", bad_grammar),
        Work("invalid JSON schema", "/v1/chat/completions", bad_schema),
        Work("unknown LoRA model", "/v1/completions", {**completion, "model": "no-such-adapter"}),
        Work("unknown LoRA name (MindIE)", "/infer_token", _infer(0, 5, lora_name="no-such-adapter")),
        Work("bad token ids", "/infer_token", _infer(0, 5, prompt=[1, 10**6 + 7])),
        Work("negative token id", "/v1/completions", {**completion, "prompt": [1, -5]}),
        Work("slow-drip body", "/v1/completions", None),
    ]]


def _drip():
    """A malformed body sent in DRIP_CHUNKS pieces DRIP_GAP_S apart (chunked, bounded)."""
    for piece in (b'{"model": "tiny-llama",', b' "prompt": "drip', *[b"p" * 64] * (DRIP_CHUNKS - 3), b'", "n": '):
        time.sleep(DRIP_GAP_S)
        yield piece


def send(client: httpx.Client, url: str, work: Work, rng: random.Random | None = None,
         leave_after: int | None = None, leave_before_s: float | None = None) -> Record:
    """Send ``work`` and read its answer. ``leave_after``: the client leaves a stream after that many
    events; ``leave_before_s``: it gives up on a whole answer after that many seconds."""
    record = Record(work, time.monotonic())
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, read=leave_before_s) if leave_before_s else CLIENT_TIMEOUT_S
    if work.body is None:
        content, kwargs = _drip(), {"headers": {"content-type": "application/json"}}
    elif isinstance(work.body, bytes):
        content, kwargs = work.body, {"headers": {"content-type": "application/json"}}
    else:
        content, kwargs = None, {"json": {**work.body, "stream": True} if work.stream else work.body}
    try:
        with client.stream("POST", url + work.path, content=content, timeout=timeout, **kwargs) as response:
            record.status = response.status_code
            if response.status_code != 200:
                _read_error(record, response.read().decode(errors="replace"))
            elif work.stream:
                _read_events(record, response, leave_after)
            else:
                _read_whole(record, json.loads(response.read()))
    except httpx.TimeoutException as error:
        if leave_before_s:
            record.disconnected = True
        else:
            record.failure = f"no answer within {CLIENT_TIMEOUT_S} s ({type(error).__name__})"
    except (httpx.HTTPError, ValueError) as error:
        record.failure = type(error).__name__
    except Exception as error:  # an answer of the wrong shape (a 200 without choices...): counted, not lost
        record.failure = f"unreadable answer: {type(error).__name__}: {error}"
    record.ended_at = time.monotonic()
    return record


def _read_error(record: Record, text: str) -> None:
    record.error_body += text
    try:
        error = json.loads(text)
        error = error.get("error", error) if isinstance(error, dict) else {}
        record.error, record.error_code = str(error.get("message", text)), error.get("code") or error.get("type")
    except ValueError:
        record.error = text[:200]
    record.terminals += 1


def _read_events(record: Record, response: httpx.Response, leave_after: int | None) -> None:
    events = 0
    if leave_after == 0:  # the client leaves as soon as the headers came
        record.disconnected = True
        return
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if record.terminals:
            record.after_terminal += 1
        if line == "data: [DONE]":
            record.terminals += 1
            continue
        event = json.loads(line[6:])
        events += 1
        record.event_times.append(time.monotonic())
        if record.ttft_s is None:
            record.ttft_s = time.monotonic() - record.sent_at
        _read_event(record, event)
        if leave_after is not None and events >= leave_after and not record.terminals:
            record.disconnected = True
            return


def _read_event(record: Record, event: dict) -> None:
    if "error" in event:
        record.error_body += json.dumps(event)
        record.error, record.error_code = event["error"].get("message"), event["error"].get("code")
    elif record.work.path == "/infer_token":
        if event.get("token"):  # the last event's text is null (seeds/000): generated_text has it all
            record.texts[0] = record.texts.get(0, "") + (event["token"]["text"] or "")
        details = event.get("details") or {}
        if details.get("err_msg"):
            record.error_body += json.dumps(details)
            record.error = details["err_msg"]
        if "generated_text" in event:
            if not details.get("err_msg"):
                record.texts[0] = event["generated_text"]
            record.terminals += 1
            record.finishes.setdefault(0, []).append(details.get("finish_reason"))
    else:
        for choice in event.get("choices", []):
            i = choice["index"]
            delta = choice.get("delta", choice)
            record.texts[i] = record.texts.get(i, "") + (delta.get("content") or delta.get("text") or "")
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                record.texts[i] += (f"<{function['name']}>" if function.get("name") else "") + \
                    (function.get("arguments") or "")
            if choice.get("finish_reason"):
                record.finishes.setdefault(i, []).append(choice["finish_reason"])


def _read_whole(record: Record, answer: dict) -> None:
    record.terminals += 1
    record.ttft_s = time.monotonic() - record.sent_at
    if record.work.path == "/infer_token":
        record.texts[0] = answer["generated_text"]
        record.finishes[0] = [(answer.get("details") or {}).get("finish_reason")]
        return
    for choice in answer["choices"]:
        message = choice.get("message")
        text = (message.get("content") or "") if message else choice["text"]
        for call in (message or {}).get("tool_calls") or []:
            text += f"<{call['function']['name']}>{call['function']['arguments']}"
        record.texts[choice["index"]] = text
        record.finishes[choice["index"]] = [choice["finish_reason"]]


def reference(client: httpx.Client, url: str, work: Work) -> Record:
    """The fault-free answer of ``work`` (a whole answer: the same text a stream delivers). A clean 503
    (engines not ready yet, just after the deploy on a loaded machine) is asked again, as a client
    told Retry-After would: at most REFERENCE_TRIES times, a second apart."""
    body = {k: v for k, v in work.body.items() if k != "timeout"}  # a deadline's reference is the whole answer
    for attempt in range(1, REFERENCE_TRIES + 1):
        record = send(client, url, Work(work.name, work.path, body))
        if record.status != 503 or attempt == REFERENCE_TRIES:
            return record
        time.sleep(1)
