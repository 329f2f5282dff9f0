"""The HTTP ingress: builds each replica's FastAPI app and binds each route to its dialect; the one
module of the ingress process that binds deployments/ to dialects/ (docs/architecture.md, "The rooms").

Each ingress replica builds its own app (``build_app``, which Ray Serve calls through
``Ingress.__serve_build_asgi_app__`` once the replica's Ingress is built): the dialects' error
handlers and door (dialects/http_edge.py), the middleware that applies the door and the key's rate
limits and counts every request, the Files and Batch routes (dialects/batch_routes.py), then the
Ingress's own route methods, bound to it. No app is module-level: nothing is shared or mutated
across replicas or imports.

The Ingress holds the engine client (deployments/ingress/engine_client.py: the engine deployments
through deployments/pd/backends.py, admission, migration and traces) and never runs a model itself.
Each route's body is its dialect's (dialects/: MindIE's /infer_token in dialects/mindie_serving.py;
the OpenAI-compatible /v1 API, OpenAI's Responses and Anthropic's Messages in
dialects/openai_serving.py; Databricks' invocations in dialects/databricks.py), which calls the
engine client through its seam (dialects/engine_client.py) and never sees Ray. The operations
routes' answers (/health, the page, traces, metrics) are deployments/ingress/operation_routes.py's.
"""

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from ray import serve

from deployments.pd import routing
from deployments.ingress.admission import Admission
from deployments.pd.backends import ColocatedBackend, PDBackend
from deployments.ingress.batch_service import serve_batches
from deployments.config import AppArgs
from deployments.ingress.engine_client import ENGINE_WAIT_S, ServeEngineClient, client_error, on_unexpected_error
from deployments.ingress.health import Readiness
from deployments.pd.kv_connector import make_kv_connector
from deployments.ingress.metrics import IngressMetrics
from deployments.ingress import operation_routes as operations
from deployments.ingress.tracing import RecentTraces, RequestTrace, SpanWriter, log_line
from dialects import anthropic, auth, batch_routes, databricks, files_api, mindie, responses
from dialects.anthropic_schema import CountTokensRequest, MessagesRequest
from dialects.engine_client import Origin, ServedSettings
from dialects.errors import APIError, documented
from dialects.http_edge import GENERATION, door_refusal, in_dialect, install_error_handlers, rate_limited
from dialects.mindie_serving import MindIEServing
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from dialects.openai_serving import OpenAIServing
from dialects.openapi_doc import Served, openapi_schema
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
    """The request's origin for its trace; its priority labels the request counter (``limit_and_count``).
    A batch line is marked in its ASGI scope's state by the runner's sender (batch_service.py), which
    no client reaches."""
    http.state.priority = priority
    return Origin(dialect, http.headers.get("x-request-id"), http.state.arrival, http.state.rate_key,
                  getattr(http.state, "batch_line", False))


def route(method: str, path: str, **options):
    """Marks an Ingress method as the route ``method path`` (``options``: FastAPI's, as ``app.post``
    takes them); ``build_app`` binds it to the replica's Ingress."""
    def mark(function):
        function.route = (method, path, options)
        return function
    return mark


def build_app(ingress) -> FastAPI:
    """An ingress replica's app: the dialects' error handlers, the door's middleware
    (``limit_and_count``), the Files and Batch routes, then each route method of the Ingress, bound
    to ``ingress``, in the order the class declares them (the order of /openapi.json)."""
    app = FastAPI(title="pdserve", description="LLM serving with prefill/decode disaggregation on Ray Serve",
                  openapi_url=None, docs_url=None, redoc_url=None)  # /openapi.json and /docs are routes below
    install_error_handlers(app, on_unexpected_error)
    app.middleware("http")(limit_and_count)
    app.include_router(batch_routes.router)
    for klass in reversed(type(ingress).__mro__):  # the class as written, and Serve's wrapper around it
        for name, function in vars(klass).items():
            if hasattr(function, "route"):
                method, path, options = function.route
                app.add_api_route(path, getattr(ingress, name), methods=[method], **options)
    return app


async def limit_and_count(request: Request, call_next):
    """The door (dialects/http_edge.py: 401 on a model route without the API key, 413 for a body over
    its bound), then 429 past the key's rate limits (deployments/ingress/rate_limits.py), each in the
    route's dialect; every request counted by endpoint, status and priority."""
    request.state.arrival = time.time()  # the start of the request's trace (deployments/ingress/tracing.py)
    path = auth.route_path(request.scope)
    refusal = await door_refusal(request, path)
    if refusal is None and (limiter := getattr(request.app.state, "rate_limits", None)) is not None:
        if (limited := await limiter.refusal(request, rate_limited(path))) is not None:
            refusal = client_error(limited).response()
    response = in_dialect(path, refusal) if refusal is not None else await call_next(request)
    metrics: IngressMetrics = request.app.state.metrics
    matched = request.scope.get("route")  # the matched route's template: bounded label values
    metrics.requests.labels(matched.path if matched else "unmatched", str(response.status_code),
                            str(getattr(request.state, "priority", "-"))).inc()
    return response


async def openapi_document(app: FastAPI, engines: ServeEngineClient, embedder) -> tuple[dict, bool]:
    """(the schema, whether to keep it): with this deployment's limits once the engines answer;
    without them, and not to be kept, while they are not ready."""
    try:
        info = await asyncio.wait_for(engines.model_info(), ENGINE_WAIT_S)
        served = Served(engines.settings.served_model_name, info, list(await engines.lora_names()))
        if embedder is not None:
            served.embedding_name, served.embedding_vocab = await asyncio.wait_for(
                asyncio.gather(embedder.info.remote(), embedder.vocab_size.remote()), ENGINE_WAIT_S)
    except Exception:
        return openapi_schema(app, None), False
    return openapi_schema(app, served), True


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()  # no app here: each replica builds its own (__serve_build_asgi_app__)
class Ingress:
    def __init__(self, args: AppArgs, lora_store=None, llm=None, prefill=None, decode=None, embedder=None) -> None:
        """``lora_store``: the app's LoraStore (deployments/replicas/lora_store.py); None serves no adapters."""
        self.args = args
        self.backend = (ColocatedBackend(llm, args.stall_timeout_s) if llm is not None
                        else PDBackend(prefill, decode, args.kv_lease_s, args.stall_timeout_s, args.disaggregation,
                                       make_kv_connector(args.kv_transport, args.kv_lease_s),
                                       args.pd_degrade_to_prefill, args.pd_degrade_to_decode))
        self.embedder = embedder
        if args.prefix_store_mib and llm is None:
            routing.set_prefix_store("PrefillServer")
        if not args.pd_prefill_affinity:
            routing.set_affinity_off("PrefillServer")
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
        self._openapi: dict | None = None
        self.responses = responses.ResponseStore()  # /v1/responses' stored responses: this replica's only
        self.readiness = Readiness(self.backend, embedder, self.engines.model_info)
        self._watcher = asyncio.get_running_loop().create_task(self.readiness.watch_start())

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """This replica's app (Ray Serve calls it once the Ingress is built): its routes bound to this
        Ingress, and on its state what the middleware and the Files and Batch routes read."""
        app, args = build_app(self), self.args
        app.state.metrics = self.metrics
        app.state.max_body_bytes = args.max_body_bytes
        app.state.max_upload_bytes = args.max_file_bytes + files_api.FORM_BYTES
        app.state.api_key = args.api_key.get_secret_value() if args.api_key is not None else None
        # /v1/files, /v1/batches and per-key limits; each engine request's tokens count against its key
        self.engines.charge = serve_batches(app, args, self.backend.handles, self.metrics,
                                            files_api.UploadLimits(args.max_file_bytes, args.max_batch_lines),
                                            lambda: self.engines.interactive_in_flight > 0).charge
        return app

    def end_trace(self, trace: RequestTrace, outcome: str) -> None:
        """Each ended request: its metrics, its log line, GET /traces, and its spans if exported."""
        self.metrics.observe(trace)
        log_line(trace, outcome)
        self.traces.add(trace, outcome)
        if self.spans is not None:
            self.spans.write(trace, outcome)

    @route("POST", "/infer_token", responses=GENERATION)
    async def infer_token(self, body: mindie.InferTokenRequest, http: Request):
        return await self.mindie.infer_token(body, origin(http, "mindie", body.parameters.priority))

    @route("POST", "/v1/chat/completions", responses=GENERATION)
    async def chat_completions(self, body: ChatCompletionRequest, http: Request):
        return await self.openai.generate(body, origin(http, "openai", body.priority), chat=True)

    @route("POST", "/v1/completions", responses=GENERATION)
    async def completions(self, body: CompletionRequest, http: Request):
        return await self.openai.generate(body, origin(http, "openai", body.priority), chat=False)

    @route("POST", "/v1/responses", responses=GENERATION)
    async def create_response(self, body: ResponsesRequest, http: Request):
        came_from = origin(http, "openai", body.priority)
        exchange = responses.ResponsesExchange(body, await self.openai.frontend(), self.responses)
        return await self.openai.through_chat(exchange, body, came_from)

    @route("GET", "/v1/responses/{response_id}", responses=documented(404))
    async def get_response(self, response_id: str):
        return self.responses.get(response_id, "response_id").response

    @route("POST", "/v1/messages", responses={200: GENERATION[200], **anthropic.documented(400, 404, 408, 413, 503)})
    async def messages(self, body: MessagesRequest, http: Request):
        came_from = origin(http, "openai", body.priority)
        exchange = anthropic.MessagesExchange(body, await self.openai.frontend())
        return await self.openai.through_chat(exchange, body, came_from)

    @route("POST", "/v1/messages/count_tokens", responses=anthropic.documented(400, 404, 413, 503))
    async def count_tokens(self, body: CountTokensRequest):
        return anthropic.count_tokens(body, await self.openai.frontend())

    @route("POST", "/v1/embeddings", responses=documented(400, 404, 413, 503))
    async def embeddings(self, body: EmbeddingRequest):
        return await self.openai.embeddings(body)

    # Not in /openapi.json: its body is one of the three /v1 bodies, told apart by a field, which no
    # schema there states (a generated body or {name} would be refused: docs/api.md).
    @route("POST", "/serving-endpoints/{name}/invocations", include_in_schema=False)
    async def invocations(self, name: str, body: dict, http: Request):
        """Databricks' Foundation Model API: ``name`` the model; ``messages``, ``prompt`` or ``input``
        in the body picks chat, completions or embeddings (dialects/databricks.py)."""
        return await self.databricks.invoke(name, body, lambda priority: origin(http, "databricks", priority))

    # ---- vLLM's tokenizer routes -------------------------------------------------------

    @route("POST", "/tokenize", response_model=TokenizeResponse, responses=documented(400, 404, 413, 503))
    async def tokenize(self, body: TokenizeRequest):
        """A prompt, or chat messages through the model's chat template, as token ids (vLLM's shape)."""
        return tokenize_api.tokenize(await self.openai.frontend(), body)

    @route("POST", "/detokenize", response_model=DetokenizeResponse, responses=documented(400, 404, 413, 503))
    async def detokenize(self, body: DetokenizeRequest):
        return tokenize_api.detokenize(await self.openai.frontend(), body)

    # ---- operations: the answers are deployments/ingress/operation_routes.py's ------------------

    @route("GET", "/health", responses={503: {"description": "not ready: which deployment, and why"}})
    async def health(self):
        """200 once a canary request went through every engine deployment (P, the KV hand-off
        and D; or the colocated engine) within the last seconds; else 503 naming each deployment
        that is missing, pending or failing (deployments/ingress/health.py)."""
        return await operations.health(self.readiness)

    @route("GET", "/v1/models", responses=documented(503))
    async def models(self):
        return await self.openai.models()

    @route("GET", "/v1/models/{model_id}", responses=documented(404, 503))
    async def model(self, model_id: str):
        return await self.openai.model(model_id)

    @route("GET", "/openapi.json", include_in_schema=False)
    async def openapi(self, http: Request):
        """The schema with this deployment's limits (without them while the engines are not ready)."""
        if self._openapi is None:
            schema, keep = await openapi_document(http.app, self.engines, self.embedder)
            if not keep:
                return schema
            self._openapi = schema
        return self._openapi

    @route("GET", "/docs", include_in_schema=False)
    async def docs(self, http: Request):
        return operations.docs_page(http.app, http)

    @route("GET", "/", include_in_schema=False)
    async def web_page(self):
        return operations.web_page()

    @route("GET", "/traces/{request_id}", responses=documented(404))
    async def trace(self, request_id: str):
        """The recorded phases of a request that ended on this ingress replica (one of its last
        1024): a response id (chatcmpl-…, its engine requests) or an engine request id."""
        answer = operations.trace(self.traces, self.backend, request_id)
        if answer is None:
            raise APIError(404, f"request_id: no ended request {request_id!r} among this ingress's last "
                           f"{self.traces.capacity}", "request_id", "not_found")
        return answer

    @route("GET", "/metrics", response_class=PlainTextResponse)
    async def prometheus(self):
        return await operations.prometheus(self.metrics, self.backend)
