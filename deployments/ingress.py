"""The HTTP ingress: validates requests and streams the engines' tokens back.

One FastAPI app behind ``@serve.ingress``; it holds handles to the engine deployments
(deployments/backends.py) and to the embeddings deployment, and never runs a model itself.
It binds the HTTP dialects (dialects/: MindIE's /infer_token in dialects/mindie.py, the
OpenAI-compatible /v1 API in dialects/openai_api.py, OpenAI's Responses in dialects/responses.py,
Anthropic's Messages in dialects/anthropic.py) to the backends; the dialects never see Ray.

Its routes: the generation dialects here; the operations routes (/health, models, the schema,
the page, traces, metrics) in deployments/operation_routes.py; the FastAPI app with its error
handlers and middleware in deployments/http_app.py.
"""

import asyncio
import base64
import json
from typing import AsyncIterator
import uuid

from fastapi import Request
import numpy as np
from fastapi.responses import StreamingResponse
from ray import serve
from transformers import AutoTokenizer

from deployments import routing
from deployments.admission import Admission, Overloaded, admitted
from deployments.backends import ColocatedBackend, PDBackend, merge
from deployments.config import AppArgs
from deployments.failures import client_error
from deployments.health import Readiness, describe
from deployments.kv_connector import make_kv_connector
from deployments.http_app import ENGINE_WAIT_S, GENERATION, SSE, app
from deployments.metrics import IngressMetrics
from deployments.migration import migrating
from deployments.operation_routes import OperationRoutes
from deployments.tracing import RecentTraces, RequestTrace, SpanWriter, log_line, traced
from dialects import anthropic, mindie, responses
from dialects.anthropic_schema import CountTokensRequest, MessagesRequest
from dialects.errors import APIError, documented
from dialects.openai_api import Choice, OpenAIFrontend, now_seconds
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from dialects.openai_stream import StreamWriter
from dialects import tokenize as tokenize_api
from dialects.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from dialects.responses_schema import ResponsesRequest
from engine.execution.lora import LoraRef, ModelShape, from_trtllm
from engine.model_info import ModelInfo
from engine.outputs import TIMEOUT, RequestOutput
from engine.request import GenerationRequest

# Helpers the Ingress calls are defined above it: the class is captured when @serve.ingress runs,
# and functions defined further down were missing in the replica (NameError).


async def prepend_first(first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The first output, then the rest of its stream."""
    try:
        yield first
        async for output in stream:
            yield output
    finally:
        await stream.aclose()


def choice_position(choices: list[Choice], stream: int, output: RequestOutput) -> int:
    """Where an output of prompt ``stream``'s request goes: its choices are consecutive."""
    return stream * choices[0].request.n + output.index


async def collect_choices(streams, choices: list[Choice], fail_on_timeout: bool) -> None:
    merged = merge(streams)
    try:
        async for i, output in merged:
            choices[choice_position(choices, i, output)].outputs.append(output)
    finally:
        await merged.aclose()
    if fail_on_timeout and any(c.final.finish_reason == TIMEOUT for c in choices):
        raise APIError(408, "the request's timeout passed before it finished", "timeout", "timeout")


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def openai_error_events(error: BaseException) -> str:
    """How an OpenAI stream that has begun ends on a failure: the error in OpenAI's shape, then [DONE]."""
    return f"data: {json.dumps(client_error(error).body())}\n\ndata: [DONE]\n\n"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class Ingress(OperationRoutes):
    def __init__(self, args: AppArgs, lora_store=None, llm=None, prefill=None, decode=None, embedder=None) -> None:
        """``lora_store``: the app's LoraStore (deployments/lora_store.py); None serves no adapters."""
        self.args = args
        self.lora_store = lora_store
        self._lora_names: dict[str, LoraRef] | None = None
        self._lora_shape: ModelShape | None = None
        self.backend = (ColocatedBackend(llm, args.stall_timeout_s) if llm is not None
                        else PDBackend(prefill, decode, args.kv_lease_s, args.stall_timeout_s, args.disaggregation,
                                       make_kv_connector(args.kv_transport, args.kv_lease_s)))
        self.embedder = embedder
        roles = list(self.backend.handles)  # P then D, or the colocated engine
        self.admission = Admission(roles[0] if len(roles) > 1 else None, roles[-1], args.admission_tokens_per_replica,
                                   args.max_ongoing_requests, routing.replica_count)
        self.metrics = IngressMetrics()
        self.spans = SpanWriter(args.traces_exporter) if args.traces_exporter != "none" else None
        self.traces = RecentTraces()  # GET /traces/{id}
        app.state.metrics = self.metrics
        app.state.max_body_bytes = args.max_body_bytes
        app.state.api_key = args.api_key.get_secret_value() if args.api_key is not None else None
        self._info: ModelInfo | None = None
        self._frontend: OpenAIFrontend | None = None
        self._openapi: dict | None = None
        self.responses = responses.ResponseStore()  # /v1/responses' stored responses: this replica's only
        self.readiness = Readiness(self.backend, embedder)
        self._watcher = asyncio.get_running_loop().create_task(self.readiness.watch_start())

    # ---- the engines -------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        """What the engines serve; a 503 within ENGINE_WAIT_S while one of them does not answer."""
        if self._info is None:
            try:
                calls = [h.info.remote() for h in self.backend.handles.values()]
                infos = await asyncio.wait_for(asyncio.gather(*calls), ENGINE_WAIT_S)
            except Exception as error:
                raise APIError(503, f"the engines are not ready ({describe(error)}); GET /health says which",
                               code="not_ready") from None
            if len({i.model_id for i in infos}) != 1:
                raise APIError(503, "the prefill and decode deployments serve different models")
            self._info = infos[0]
        return self._info

    async def lora_names(self) -> dict[str, LoraRef]:
        """The adapters served by name (AppArgs.lora_modules), fixed at start."""
        if self._lora_names is None:
            self._lora_names = {} if self.lora_store is None else await self.lora_store.names.remote()
        return self._lora_names

    async def infer_token_lora(self, p: mindie.InferParameters) -> LoraRef | None:
        """The adapter /infer_token's LoRA fields name: a served name, a task id the app holds, or a
        task's weights sent now (checked here against the model, then held by the store)."""
        tensors = mindie.lora_tensors(p)
        if p.lora_name is not None:
            ref = (await self.lora_names()).get(p.lora_name)
            if ref is None:
                raise ValueError(f"parameters.lora_name: no adapter is named {p.lora_name!r} here (lora_modules)")
            return ref
        if p.lora_task_id is None:
            return None
        if self.lora_store is None:
            raise ValueError("parameters.lora_task_id: this application serves no LoRA adapters (start it with "
                             "enable_lora=true)")
        if tensors is None:
            ref = await self.lora_store.task.remote(p.lora_task_id)
            if ref is None:
                raise ValueError(f"parameters.lora_task_id: task {p.lora_task_id} is not cached; send lora_weights "
                                 "and lora_config with it")
            return ref
        if self._lora_shape is None:
            self._lora_shape = await self.lora_store.shape.remote()
        try:
            adapter = from_trtllm(f"task-{p.lora_task_id}", *tensors, self._lora_shape)
            adapter.check(self._lora_shape, self.args.max_lora_rank, "lora_weights")
        except ValueError as error:
            raise ValueError(f"parameters.{error}") from None
        return await self.lora_store.put_task.remote(p.lora_task_id, adapter)

    async def embedder_name(self) -> str:
        try:
            return await asyncio.wait_for(self.embedder.info.remote(), ENGINE_WAIT_S)
        except Exception as error:
            raise APIError(503, f"the embeddings deployment is not ready ({describe(error)})",
                           code="not_ready") from None

    async def frontend(self) -> OpenAIFrontend:
        if self._frontend is None:
            info = await self.model_info()
            tokenizer = AutoTokenizer.from_pretrained(info.model_path, local_files_only=True)
            self._frontend = OpenAIFrontend(tokenizer, self.served_model_name(info), info.vocab_size,
                                            info.max_model_len, info.max_iter_times, self.args.finish_reasons,
                                            await self.lora_names())
        return self._frontend

    def served_model_name(self, info: ModelInfo) -> str:
        """``served_model_name``, else the last part of ``model`` ("tiny-llama", "Qwen3-0.6B")."""
        return self.args.served_model_name or self.args.model.rstrip("/").rsplit("/", 1)[-1]

    async def start(self, request: GenerationRequest, http: Request, dialect: str
                    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput], RequestTrace]:
        """Send a request to the engines and wait for its first output: errors and a deadline
        that passes before the first token become HTTP errors before any byte is sent. The
        request's trace ends with its stream."""
        trace = RequestTrace(http.headers.get("x-request-id") or uuid.uuid4().hex, request.request_id, dialect,
                             request.priority, len(request.prompt_token_ids), http.state.arrival)
        def on_migrate() -> None:
            trace.migrations += 1

        try:
            ticket = self.admission.admit(request)
        except Overloaded as error:  # at once, never a wait: deployments/admission.py
            raise APIError(503, str(error), code="overloaded", retry_after=error.retry_after) from None
        resilient = migrating(lambda r: self.backend.stream(r, trace), request, self.args.max_migrations, on_migrate)
        stream = admitted(traced(resilient, trace, self.end_trace), ticket)
        try:
            first = await stream.__anext__()
        except Exception as error:
            await stream.aclose()
            raise client_error(error) from None
        if first.finished and first.finish_reason == TIMEOUT and not first.new_token_ids:
            await stream.aclose()
            raise APIError(408, "the request's timeout passed before its first token", "timeout", "timeout")
        return first, stream, trace

    def end_trace(self, trace: RequestTrace, outcome: str) -> None:
        self.metrics.observe(trace)
        log_line(trace, outcome)
        self.traces.add(trace, outcome)
        if self.spans is not None:
            self.spans.write(trace, outcome)

    async def start_all(self, choices: list[Choice], http: Request) -> list[AsyncIterator[RequestOutput]]:
        """Start one request per prompt (its n choices share it); if one fails, cancel the others
        and raise its error."""
        requests = list({c.prompt_index: c.request for c in choices}.values())
        started = await asyncio.gather(*(self.start(r, http, "openai") for r in requests), return_exceptions=True)
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            for s in started:
                if not isinstance(s, BaseException):
                    await s[1].aclose()
            raise errors[0]
        return [prepend_first(first, stream) for first, stream, _ in started]

    # ---- MindIE ------------------------------------------------------------------------

    @app.post("/infer_token", responses=GENERATION)
    async def infer_token(self, body: mindie.InferTokenRequest, http: Request):
        http.state.priority = body.parameters.priority
        info = await self.model_info()
        try:
            limits = mindie.ServedLimits(info.vocab_size, info.max_iter_times + isinstance(self.backend, PDBackend),
                                         self.args.max_logits_floats, self.args.max_beam_width, info.hidden_size,
                                         self.args.max_draft_tokens)
            request = mindie.to_generation_request(body, f"infer-{uuid.uuid4().hex}",
                                                   http.state.arrival + body.parameters.timeout, limits,
                                                   await self.infer_token_lora(body.parameters))
        except ValueError as error:
            raise client_error(error) from None
        first, stream, trace = await self.start(request, http, "mindie")
        if body.stream:
            return StreamingResponse(self._infer_token_events(first, stream, body, trace), media_type=SSE)
        try:
            outputs = [first] + [output async for output in stream]
        finally:
            await stream.aclose()  # on a cancelled request, cancels the engines' call at once
        pad_id = body.parameters.pad_id if body.parameters.pad_id is not None else info.pad_token_id
        return mindie.text_response(outputs, body, pad_id)

    async def _infer_token_events(self, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                                  body: mindie.InferTokenRequest, trace: RequestTrace) -> AsyncIterator[str]:
        """prefill_time: arrival to the first token; decode_time: since the previous token (the trace's clock)."""
        sent = [first]
        try:
            yield mindie.stream_event(sent, body, True, trace.phases().get("ttft", 0.0) * 1000.0)
            async for output in stream:
                sent.append(output)
                yield mindie.stream_event(sent, body, False, trace.last_gap * 1000.0)
        except Exception as error:  # the stream has begun: end it with MindIE's last event, err_msg set
            yield mindie.error_event(sent, client_error(error).message)
        finally:
            await stream.aclose()  # a client that went away cancels the engines' call at once

    # ---- OpenAI ------------------------------------------------------------------------

    @app.post("/v1/chat/completions", responses=GENERATION)
    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        return await self._openai(body, http, chat=True)

    @app.post("/v1/completions", responses=GENERATION)
    async def completions(self, body: CompletionRequest, http: Request):
        return await self._openai(body, http, chat=False)

    async def _openai(self, body: ChatCompletionRequest | CompletionRequest, http: Request, chat: bool):
        """Chat and completions alike: make the choices, start them (errors before any byte),
        then stream chunks or collect the whole response."""
        http.state.priority = body.priority
        front = await self.frontend()
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        make_choices = front.chat_choices if chat else front.completion_choices
        choices = make_choices(body, response_id, http.state.arrival + body.timeout)
        streams = await self.start_all(choices, http)
        created = now_seconds()
        if not body.stream:
            await collect_choices(streams, choices, fail_on_timeout=chat or body.error_behavior == "error")
            if chat:
                return front.chat_response(response_id, choices, created)
            return front.completion_response(response_id, choices, front.best(choices, body.n), created, body.suffix,
                                             body.logprobs is not None)
        writer = StreamWriter(front, response_id, created, choices, chat, "" if chat else body.suffix,
                              not chat and body.logprobs is not None,
                              body.stream_options is not None and body.stream_options.include_usage)
        return StreamingResponse(self._events(streams, choices, writer, openai_error_events), media_type=SSE)

    async def _events(self, streams, choices: list[Choice], writer, on_error) -> AsyncIterator[str]:
        """A dialect's stream: ``writer`` turns each output into its events; a failure after the
        start ends it with ``on_error``'s events."""
        merged = merge(streams)
        try:
            async for i, output in merged:
                position = choice_position(choices, i, output)
                choices[position].outputs.append(output)
                if event := writer.write(position, output):
                    yield event
            yield writer.close()
        except Exception as error:  # the stream has begun: end it with an error event
            yield on_error(error)
        finally:
            await merged.aclose()

    # ---- OpenAI Responses and Anthropic Messages: each speaks through the chat request ---------

    @app.post("/v1/responses", responses=GENERATION)
    async def create_response(self, body: ResponsesRequest, http: Request):
        exchange = responses.ResponsesExchange(body, await self.frontend(), self.responses)
        return await self._through_chat(exchange, body, http)

    @app.get("/v1/responses/{response_id}", responses=documented(404))
    async def get_response(self, response_id: str):
        return self.responses.get(response_id, "response_id").response

    @app.post("/v1/messages", responses={200: GENERATION[200], **anthropic.documented(400, 404, 408, 413, 503)})
    async def messages(self, body: MessagesRequest, http: Request):
        return await self._through_chat(anthropic.MessagesExchange(body, await self.frontend()), body, http)

    @app.post("/v1/messages/count_tokens", responses=anthropic.documented(400, 404, 413, 503))
    async def count_tokens(self, body: CountTokensRequest):
        """The templated prompt's length: the chat request is made (and checked) but not started."""
        front = await self.frontend()
        (choice,) = front.chat_choices(anthropic.chat_request(body, front), "count-tokens", 0.0)
        return {"input_tokens": choice.prompt_tokens}

    async def _through_chat(self, exchange, body, http: Request):
        """Start the chat request a dialect made (errors before any byte), then return the
        dialect's whole answer or its events."""
        http.state.priority = body.priority
        choices = exchange.front.chat_choices(exchange.chat, exchange.id, http.state.arrival + body.timeout)
        streams = await self.start_all(choices, http)
        if body.stream:
            writer = exchange.writer(choices)
            return StreamingResponse(self._events(streams, choices, writer, lambda e: writer.fail(client_error(e))),
                                     media_type=SSE)
        await collect_choices(streams, choices, fail_on_timeout=True)
        return exchange.response(choices)

    @app.post("/v1/embeddings", responses=documented(400, 404, 413, 503))
    async def embeddings(self, body: EmbeddingRequest):
        if self.embedder is None:
            raise APIError(404, "embeddings are not served by this application", "model", "model_not_found")
        name = await self.embedder_name()
        if body.model is not None and body.model != name:
            raise APIError(404, f"model: {body.model!r} is not served here; embeddings are {name!r}", "model",
                           "model_not_found")
        try:
            result = await self.embedder.embed.remote(body.inputs())
        except Exception as error:
            raise client_error(error) from None
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "model": name,
                "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(v, body.encoding_format)}
                         for i, v in enumerate(result.vectors)],
                "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}

    # ---- vLLM's tokenizer routes -------------------------------------------------------

    @app.post("/tokenize", response_model=TokenizeResponse, responses=documented(400, 404, 413, 503))
    async def tokenize(self, body: TokenizeRequest):
        """A prompt, or chat messages through the model's chat template, as token ids (vLLM's shape)."""
        return tokenize_api.tokenize(await self.frontend(), body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=documented(400, 404, 413, 503))
    async def detokenize(self, body: DetokenizeRequest):
        return tokenize_api.detokenize(await self.frontend(), body)
