"""One streamed request to a pdserve endpoint, timed token by token."""

from __future__ import annotations

from dataclasses import dataclass, field
import json
import time

import httpx

from tools.loadgen import Work

ENDPOINTS = {"infer_token": "/infer_token", "chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class Result:
    work: Work
    status: int = 0  # HTTP status; 0 when the request never got an answer
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0  # seconds
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between consecutive tokens
    output_tokens: int = 0
    input_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # /infer_token: the streamed ids (a conversation's next turn)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(endpoint: str, work: Work, model: str, timeout: int) -> dict:
    if endpoint == "infer_token":
        return {"input_id": work.input_ids, "stream": True,
                "parameters": {"max_new_tokens": work.output_len, "ignore_eos": True, "priority": work.priority,
                               "timeout": timeout}}
    common = {"model": model, "max_tokens": work.output_len, "stream": True, "ignore_eos": True,
              "priority": work.priority, "timeout": timeout, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        return {**common, "messages": [{"role": "user", "content": work.prompt}]}
    return {**common, "prompt": work.prompt}


async def send(client: httpx.AsyncClient, endpoint: str, work: Work, model: str, timeout: int) -> Result:
    """Stream one request. Latencies are per event that carries text or a token (not the usage or
    [DONE]); on /v1 an event may carry several tokens (a character split over tokens waits for its
    last byte), so the output is counted from the usage chunk, as vLLM's benchmark counts it."""
    result = Result(work, start=time.perf_counter(), input_tokens=len(work.input_ids))
    last = None
    try:
        async with client.stream("POST", ENDPOINTS[endpoint], json=request_body(endpoint, work, model, timeout),
                                 timeout=timeout + 30) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:200]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "stream error")
                    break
                if event.get("usage"):  # the last event before [DONE]
                    result.input_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                if not _is_token(endpoint, event):
                    continue
                now = time.perf_counter()
                if endpoint == "infer_token":
                    result.token_ids.append(event["token"]["id"])
                if last is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += 1
    except (httpx.HTTPError, OSError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.e2el = time.perf_counter() - result.start
    return result


async def send_each(base_url: str, works: list[Work], endpoint: str = "infer_token", model: str = "tiny-llama",
                    timeout: int = 120) -> list[Result]:
    """``works`` sent one after another over one connection pool, each streamed and timed."""
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        return [await send(client, endpoint, w, model, timeout) for w in works]


def _is_token(endpoint: str, event: dict) -> bool:
    if endpoint == "infer_token":
        return event.get("token") is not None
    choices = event.get("choices") or []
    if not choices:
        return False
    if endpoint == "chat":  # the finishing chunk has an empty delta
        return choices[0].get("delta", {}).get("content") is not None
    return True  # completions: one chunk per token, the last one with its finish_reason
