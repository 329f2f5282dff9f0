"""The HTTP ingress: binds each route to its dialect, and does admission, tracing and auth.

One FastAPI app behind ``@serve.ingress``; it holds the engine client (deployments/ingress/engine_client.py:
the engine deployments through deployments/pd/backends.py, admission, migration and traces) and never
runs a model itself. Each route's body is its dialect's (dialects/: MindIE's /infer_token in
dialects/mindie_serving.py; the OpenAI-compatible /v1 API, OpenAI's Responses and Anthropic's
Messages in dialects/openai_serving.py; Databricks' invocations in dialects/databricks.py), which calls the engine client through its seam
(dialects/engine_client.py) and never sees Ray.

Its routes: the generation dialects, and the operations routes (/health, models, the schema, the
page, traces, metrics), whose answers are deployments/ingress/operation_routes.py's; the FastAPI app with
its error handlers and middleware in deployments/ingress/http_app.py.
"""

import asyncio

from fastapi import Request
from fastapi.responses import PlainTextResponse
from ray import serve

from deployments.pd import routing
from deployments.ingress.admission import Admission
from deployments.pd.backends import ColocatedBackend, PDBackend
from deployments.ingress.batch_service import serve_batches
from deployments.config import AppArgs
from deployments.ingress.engine_client import ServeEngineClient
from deployments.ingress.health import Readiness
from deployments.pd.kv_connector import make_kv_connector
from deployments.ingress.http_app import GENERATION, app
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress import operation_routes as operations
from deployments.ingress.tracing import RecentTraces, RequestTrace, SpanWriter, log_line
from dialects import anthropic, databricks, files_api, mindie, responses
from dialects.anthropic_schema import CountTokensRequest, MessagesRequest
from dialects.engine_client import Origin, ServedSettings
from dialects.errors import documented
from dialects.mindie_serving import MindIEServing
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from dialects.openai_serving import OpenAIServing
from dialects import tokenize as tokenize_api
from dialects.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from dialects.responses_schema import ResponsesRequest


def served_settings(args: AppArgs, pd: bool, serves_lora: bool) -> ServedSettings:
    """What the dialects answer with of the app's arguments. ``served_model_name``, else the last
    part of ``model`` ("tiny-llama", "Qwen3-0.6B")."""
    return ServedSettings(args.served_model_name or args.model.rstrip("/").rsplit("/", 1)[-1],
                          args.finish_reasons, args.max_logits_floats, args.max_beam_width, args.max_draft_tokens,
                          args.max_lora_rank, args.lora_directories, serves_lora, 1 if pd else 0,
                          tuple(args.model_aliases))


def origin(http: Request, dialect: str, priority: int) -> Origin:
    """The request's origin for its trace; its priority labels the request counter (http_app.py)."""
    http.state.priority = priority
    return Origin(dialect, http.headers.get("x-request-id"), http.state.arrival, http.state.rate_key)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class Ingress:
    def __init__(self, args: AppArgs, lora_store=None, llm=None, prefill=None, decode=None, embedder=None) -> None:
        """``lora_store``: the app's LoraStore (deployments/replicas/lora_store.py); None serves no adapters."""
        self.args = args
        self.backend = (ColocatedBackend(llm, args.stall_timeout_s) if llm is not None
                        else PDBackend(prefill, decode, args.kv_lease_s, args.stall_timeout_s, args.disaggregation,
                                       make_kv_connector(args.kv_transport, args.kv_lease_s),
                                       args.pd_degrade_to_prefill, args.pd_degrade_to_decode))
        self.embedder = embedder
        roles = list(self.backend.handles)  # P then D, or the colocated engine
        admission = Admission(roles[0] if len(roles) > 1 else None, roles[-1], args.admission_tokens_per_replica,
                              args.max_ongoing_requests, routing.replica_count)
        self.engines = ServeEngineClient(served_settings(args, isinstance(self.backend, PDBackend), lora_store is not None),
                                         self.backend,
                                         admission, args.max_migrations, self.end_trace, lora_store, embedder)
        self.openai = OpenAIServing(self.engines)
        self.mindie = MindIEServing(self.engines)
        self.databricks = databricks.DatabricksServing(self.openai)
        self.metrics = IngressMetrics()
        self.spans = SpanWriter(args.traces_exporter) if args.traces_exporter != "none" else None
        self.traces = RecentTraces()  # GET /traces/{id}
        app.state.metrics = self.metrics
        app.state.max_body_bytes = args.max_body_bytes
        app.state.api_key = args.api_key.get_secret_value() if args.api_key is not None else None
        # /v1/files, /v1/batches and per-key limits; each engine request's tokens count against its key
        app.state.max_upload_bytes = args.max_file_bytes + files_api.FORM_BYTES
        self.engines.charge = serve_batches(app, args, self.backend.handles, self.metrics,
                                            files_api.UploadLimits(args.max_file_bytes, args.max_batch_lines)).charge
        self._openapi: dict | None = None
        self.responses = responses.ResponseStore()  # /v1/responses' stored responses: this replica's only
        self.readiness = Readiness(self.backend, embedder)
        self._watcher = asyncio.get_running_loop().create_task(self.readiness.watch_start())

    def end_trace(self, trace: RequestTrace, outcome: str) -> None:
        """Each ended request: its metrics, its log line, GET /traces, and its spans if exported."""
        self.metrics.observe(trace)
        log_line(trace, outcome)
        self.traces.add(trace, outcome)
        if self.spans is not None:
            self.spans.write(trace, outcome)

    @app.post("/infer_token", responses=GENERATION)
    async def infer_token(self, body: mindie.InferTokenRequest, http: Request):
        return await self.mindie.infer_token(body, origin(http, "mindie", body.parameters.priority))

    @app.post("/v1/chat/completions", responses=GENERATION)
    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        return await self.openai.generate(body, origin(http, "openai", body.priority), chat=True)

    @app.post("/v1/completions", responses=GENERATION)
    async def completions(self, body: CompletionRequest, http: Request):
        return await self.openai.generate(body, origin(http, "openai", body.priority), chat=False)

    @app.post("/v1/responses", responses=GENERATION)
    async def create_response(self, body: ResponsesRequest, http: Request):
        came_from = origin(http, "openai", body.priority)
        exchange = responses.ResponsesExchange(body, await self.openai.frontend(), self.responses)
        return await self.openai.through_chat(exchange, body, came_from)

    @app.get("/v1/responses/{response_id}", responses=documented(404))
    async def get_response(self, response_id: str):
        return self.responses.get(response_id, "response_id").response

    @app.post("/v1/messages", responses={200: GENERATION[200], **anthropic.documented(400, 404, 408, 413, 503)})
    async def messages(self, body: MessagesRequest, http: Request):
        came_from = origin(http, "openai", body.priority)
        exchange = anthropic.MessagesExchange(body, await self.openai.frontend())
        return await self.openai.through_chat(exchange, body, came_from)

    @app.post("/v1/messages/count_tokens", responses=anthropic.documented(400, 404, 413, 503))
    async def count_tokens(self, body: CountTokensRequest):
        return anthropic.count_tokens(body, await self.openai.frontend())

    @app.post("/v1/embeddings", responses=documented(400, 404, 413, 503))
    async def embeddings(self, body: EmbeddingRequest):
        return await self.openai.embeddings(body)

    # Not in /openapi.json: its body is one of the three /v1 bodies, told apart by a field, which no
    # schema there states (a generated body or {name} would be refused: docs/api.md).
    @app.post("/serving-endpoints/{name}/invocations", include_in_schema=False)
    async def invocations(self, name: str, body: dict, http: Request):
        """Databricks' Foundation Model API: ``name`` the model; ``messages``, ``prompt`` or ``input``
        in the body picks chat, completions or embeddings (dialects/databricks.py)."""
        return await self.databricks.invoke(name, body, lambda priority: origin(http, "databricks", priority))

    # ---- vLLM's tokenizer routes -------------------------------------------------------

    @app.post("/tokenize", response_model=TokenizeResponse, responses=documented(400, 404, 413, 503))
    async def tokenize(self, body: TokenizeRequest):
        """A prompt, or chat messages through the model's chat template, as token ids (vLLM's shape)."""
        return tokenize_api.tokenize(await self.openai.frontend(), body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=documented(400, 404, 413, 503))
    async def detokenize(self, body: DetokenizeRequest):
        return tokenize_api.detokenize(await self.openai.frontend(), body)

    # ---- operations: the answers are deployments/ingress/operation_routes.py's ------------------

    @app.get("/health", responses={503: {"description": "not ready: which deployment, and why"}})
    async def health(self):
        """200 once a canary request went through every engine deployment (P, the KV hand-off
        and D; or the colocated engine) within the last seconds; else 503 naming each deployment
        that is missing, pending or failing (deployments/ingress/health.py)."""
        return await operations.health(self.readiness)

    @app.get("/v1/models", responses=documented(503))
    async def models(self):
        return await operations.models(self.openai)

    @app.get("/v1/models/{model_id}", responses=documented(404, 503))
    async def model(self, model_id: str):
        return await operations.model(self.openai, model_id)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self):
        """The schema with this deployment's limits (without them while the engines are not ready)."""
        if self._openapi is None:
            schema, keep = await operations.openapi_document(app, self.engines, self.embedder)
            if not keep:
                return schema
            self._openapi = schema
        return self._openapi

    @app.get("/docs", include_in_schema=False)
    async def docs(self, http: Request):
        return operations.docs_page(app, http)

    @app.get("/", include_in_schema=False)
    async def web_page(self):
        return operations.web_page()

    @app.get("/traces/{request_id}", responses=documented(404))
    async def trace(self, request_id: str):
        """The recorded phases of a request that ended on this ingress replica (one of its last
        1024): a response id (chatcmpl-…, its engine requests) or an engine request id."""
        return operations.trace(self.traces, self.backend, request_id)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus(self):
        return await operations.prometheus(self.metrics, self.backend)
