"""The bodies of the OpenAI-compatible routes, and of the dialects that speak through the chat
request (OpenAI's Responses, Anthropic's Messages): parse, make the choices, send them through the
engine client (dialects/engine_client.py), write the answer or its events. The ingress
(deployments/ingress/ingress.py) binds the routes here; nothing here knows Ray.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import AsyncIterator, Callable
import uuid

import numpy as np
from fastapi.responses import StreamingResponse

from dialects.engine_client import EngineClient, Generation, Origin
from dialects.errors import APIError, from_value_error
from dialects.openai_api import Choice, OpenAIFrontend, now_seconds
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from dialects.openai_stream import StreamWriter
from engine.outputs import TIMEOUT, RequestOutput

SSE = "text/event-stream"
logger = logging.getLogger("ray.serve")  # Serve's log: its lines carry the request id


def choice_position(choices: list[Choice], stream: int, index: int) -> int:
    """Where output ``index`` of prompt ``stream``'s request goes: its choices are consecutive."""
    return stream * choices[0].request.n + index


def raise_if_timed_out(output: RequestOutput) -> None:
    """The timeout rule once the first token is out (docs/api.md): an answer whose deadline passes
    ends in the dialect's error (a 408, or a stream's error event), not in a shorter answer."""
    if output.finished and output.finish_reason == TIMEOUT:
        raise APIError(408, "request timed out: the request's timeout passed before it finished", "timeout",
                       "timeout")


async def collect_choices(generation: Generation, choices: list[Choice], fail_on_timeout: bool) -> None:
    """Every output into its choice; a passed deadline is a 408 (unless ``fail_on_timeout`` is off:
    Databricks' error_behavior "truncate")."""
    try:
        async for i, output in generation:
            if fail_on_timeout:
                raise_if_timed_out(output)
            choices[choice_position(choices, i, output.index)].outputs.append(output)
    finally:
        await generation.abort()


def as_api_error(error: Exception) -> APIError:
    """The engine client's failures are APIErrors already; anything else out of a writer is ours
    (logged with its cause, as deployments/ingress/engine_client.py client_error does)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return from_value_error(error)
    logger.warning("request failed: %s: %s", type(error).__name__, error)
    return APIError(500, "the server failed while serving this request; its log has the cause under the "
                         "request's x-request-id", code="internal_error")


async def events(generation: Generation, choices: list[Choice], writer,
                 on_error: Callable[[APIError], str], timeout_is_error: bool = True) -> AsyncIterator[str]:
    """A dialect's stream: ``writer`` turns each output into its events; a failure after the
    start, a passed deadline among them (unless ``timeout_is_error`` is off: Databricks'
    error_behavior "truncate"), ends it with ``on_error``'s events."""
    try:
        async for i, output in generation:
            if timeout_is_error:
                raise_if_timed_out(output)
            position = choice_position(choices, i, output.index)
            choices[position].outputs.append(output)
            if event := writer.write(position, output):
                yield event
        yield writer.close()
    except Exception as error:  # the stream has begun: end it with an error event
        yield on_error(as_api_error(error))
    finally:
        await generation.abort()


def openai_error_events(error: APIError) -> str:
    """How an OpenAI stream that has begun ends on a failure: the error in OpenAI's shape, then [DONE]."""
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n"


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


class OpenAIServing:
    """The OpenAI-shaped routes of one ingress replica, over its engine client."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._frontend: OpenAIFrontend | None = None

    async def frontend(self) -> OpenAIFrontend:
        if self._frontend is None:
            info, settings = await self.client.model_info(), self.client.settings
            self._frontend = OpenAIFrontend(await self.client.tokenizer(), settings.served_model_name,
                                            info.vocab_size, info.max_model_len, info.max_iter_times,
                                            settings.finish_reasons, await self.client.lora_names(),
                                            settings.model_aliases)
        return self._frontend

    async def generate(self, body: ChatCompletionRequest | CompletionRequest, origin: Origin, chat: bool):
        """Chat and completions alike: make the choices, start them (errors before any byte),
        then stream chunks or collect the whole response."""
        front = await self.frontend()
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        make_choices = front.chat_choices if chat else front.completion_choices
        choices = make_choices(body, response_id, origin.arrival + body.timeout)
        generation = await self.start(choices, origin)
        created = now_seconds()
        if not body.stream:
            await collect_choices(generation, choices, fail_on_timeout=chat or body.error_behavior == "error")
            if chat:
                return front.chat_response(response_id, choices, created)
            return front.completion_response(response_id, choices, front.best(choices, body.n), created, body.suffix,
                                             body.logprobs is not None)
        writer = StreamWriter(front, response_id, created, choices, chat, "" if chat else body.suffix,
                              not chat and body.logprobs is not None,
                              body.stream_options is not None and body.stream_options.include_usage)
        return StreamingResponse(events(generation, choices, writer, openai_error_events,
                                        timeout_is_error=chat or body.error_behavior == "error"), media_type=SSE)

    async def through_chat(self, exchange, body, origin: Origin):
        """Start the chat request a dialect made (errors before any byte), then return the
        dialect's whole answer or its events (dialects/responses.py, dialects/anthropic.py)."""
        choices = exchange.front.chat_choices(exchange.chat, exchange.id, origin.arrival + body.timeout)
        generation = await self.start(choices, origin)
        if body.stream:
            writer = exchange.writer(choices)
            return StreamingResponse(events(generation, choices, writer, writer.fail), media_type=SSE)
        await collect_choices(generation, choices, fail_on_timeout=True)
        return exchange.response(choices)

    async def start(self, choices: list[Choice], origin: Origin) -> Generation:
        """One engine request per prompt (its n choices share it)."""
        return await self.client.generate(list({c.prompt_index: c.request for c in choices}.values()), origin)

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        name = await self.client.embedding_model()
        if name is None:
            raise APIError(404, "embeddings are not served by this application", "model", "model_not_found")
        if body.model is not None and body.model != name:
            raise APIError(404, f"model: {body.model!r} is not served here; embeddings are {name!r}", "model",
                           "model_not_found")
        vectors, prompt_tokens = await self.client.embed(body.inputs())
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "model": name,
                "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

    async def models(self) -> dict:
        """GET /v1/models: every model served here."""
        return {"object": "list", "data": await self.model_cards()}

    async def model(self, model_id: str) -> dict:
        """GET /v1/models/{model_id}: its card; a 404 naming ``model`` when it is not served here."""
        for card in await self.model_cards():
            if card["id"] == model_id:
                return card
        raise APIError(404, f"model: {model_id!r} is not served here", "model", "model_not_found")

    async def model_cards(self) -> list[dict]:
        """OpenAI's model objects: the LLM (with what this server adds), its LoRA adapters (as vLLM
        lists them: ``parent`` the base model, ``root`` the directory) and the embedder."""
        info, settings = await self.client.model_info(), self.client.settings
        cards = [{"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                  "max_model_len": info.max_model_len, "dtype": info.dtype,
                  "enable_prefix_caching": info.enable_prefix_caching,
                  "attention_backend": info.attention_backend, "batch_invariant": info.batch_invariant,
                  "sampler_backend": info.sampler_backend, "weight_storage": info.weight_storage}]
        cards += [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve", "parent": cards[0]["id"],
                   "root": settings.lora_directories[name]} for name in await self.client.lora_names()]
        if (embedding_model := await self.client.embedding_model()) is not None:
            cards.append({"id": embedding_model, "object": "model", "created": 0, "owned_by": "pdserve"})
        return cards
