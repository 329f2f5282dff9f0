"""The application's arguments: typed, validated, and turned into engine settings.

``serve run deployments.app:build_pd_app model=/path max_iter_times=256`` passes strings;
pydantic converts and checks them, and a bad one stops the build with a message naming it.
"""

from __future__ import annotations

from pathlib import Path
import os
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, create_model, model_validator

from deployments.pd.disaggregation import DisaggregationPolicy
from deployments.ingress.rate_limits import RateLimits
from engine.config import EngineConfig, app_settings
from engine.execution.loader import TINY_LLAMA


# Ray Serve's HTTPOptions that make its proxy serve https (ray/serve/config.py): the config's, not an app's.
TLS_OPTIONS = ("ssl_keyfile", "ssl_certfile", "ssl_keyfile_password", "ssl_ca_certs")


class _AppArgs(BaseModel):
    """The arguments that are the application's own; ``AppArgs`` adds the engine's settings."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny-llama", description="a local Hugging Face model directory, a .gguf file (or a directory "
                       "holding one), or tiny-llama; `make serve` names SmolLM2-135M-Instruct's GGUF "
                       "(configs/local.yaml), tiny-llama stays the programmatic default the fast tests use")
    prefill_model: str | None = Field(None, description="P's model, if named apart; must be the same model")
    decode_model: str | None = Field(None, description="D's model, if named apart; must be the same model")
    served_model_name: str | None = Field(None, description="the name clients use; default: the model's")
    model_aliases: list[str] = Field(default_factory=list, description="other names a request's model may give for "
                                     "the base model (e.g. gpt-3.5-turbo, as the seeds' examples send); answers "
                                     "name served_model_name")
    max_ongoing_requests: int = Field(256, gt=0, description="admission's request budget per P/D replica; the engines' Serve "
                                      "max_ongoing_requests is sized from it (deployments/ingress/admission.py)")
    finish_reasons: Literal["openai", "mindie"] = Field(
        "openai", description="finish_reason values on /v1: OpenAI's (stop, length) or MindIE's")
    max_migrations: int = Field(3, ge=0, description="times a request moves to another replica when the one "
                                "serving it fails (deployments/ingress/migration.py); 0: a failure ends it")
    kv_lease_s: float = Field(30.0, gt=0, description="PD: seconds a D replica has to take a request after P "
                              "answered; past them the request is prefilled again (deployments/pd/backends.py)")
    kv_transport: Literal["object_store", "shared_memory"] = Field(
        "object_store", description="PD: how P's KV reaches D (deployments/pd/kv_connector.py): Ray's object store "
        "(any placement), or shared_memory (/dev/shm; P, D and the ingress on one host, any raylets of it: "
        "deployments/pd/kv_direct.py)")
    pd_degrade_to_prefill: bool = Field(
        True, description="PD: while no decode replica answers (dead, stopped, stuck: deployments/pd/decode_watch.py) "
        "or none is paired with P (its KV would mean something else: deployments/pd/compatibility.py), "
        "prefill replicas serve requests whole, as colocated engines; off: such requests get a 503 at once")
    pd_degrade_to_decode: bool = Field(
        True, description="PD: while no prefill replica answers (dead, stopped, stuck: deployments/pd/decode_watch.py) "
        "and a decode replica does, decode replicas prefill requests themselves (as for a local prefill); off: such "
        "requests get a 503 at once")
    stall_timeout_s: float = Field(5.0, gt=0, description="seconds without a token or a heartbeat after which "
                                   "the ingress takes a streaming replica for stalled and moves its request "
                                   "(deployments/replicas/liveness.py); the replica says it is alive 4 times as often")
    step_timeout_s: float = Field(30.0, gt=0, description="the step watchdog: an engine step running longer "
                                  "than this stops the replica's heartbeats (its streams move, as a stalled "
                                  "replica's) and fails its health check (Serve replaces it)")
    admission_tokens_per_replica: int = Field(
        262144, gt=0, description="admission control: prompt + max_tokens of the requests in flight from the "
        "ingress to a role (P, D or colocated), per replica of it; past it a new request gets a 503 with "
        "Retry-After at once (priority 1 may use it all, priority 5 the first 60%: docs/serving.md)")
    pd_local_prefill_tokens: int = Field(
        256, ge=0, description="PD: prompts whose tokens not held by D are at most this many are computed on D "
        "(conditional disaggregation, docs/serving.md); 0: only prompts D holds whole")
    pd_prefill_busy_tokens: int = Field(
        16384, gt=0, description="PD: past this many prompt tokens in flight to each P replica (from one ingress), "
        "D computes prompts itself while its KV usage is below 0.8")
    prefix_store_mib: int = Field(0, ge=0, description="PD: MiB of host memory for the app's prefix store: full KV "
                                  "blocks of finished prefills that every prefill replica pulls instead of computing "
                                  "them (deployments/replicas/prefix_store.py, docs/serving.md); 0: off")
    pd_prefill_affinity: bool = Field(True, description="PD: route prompts to the prefill replica that was sent their "
                                      "start (deployments/pd/routing.py); off: by load alone, ties at random")
    pd_decode_prefix_reuse: bool = Field(True, description="PD: ask D how much of a prompt its prefix cache holds "
                                         "and send only the KV of the rest")
    slo_ttft_ms: float | None = Field(None, gt=0, description="the app's time-to-first-token target (ms): PD's "
                                      "policy keeps a prompt off a P whose queue would make it miss it "
                                      "(docs/serving.md, \"Prefix-aware PD\"); unset: no target")
    slo_tpot_ms: float | None = Field(None, gt=0, description="the app's time-per-output-token target (ms): PD's "
                                      "policy computes on D only a rest that fits in D's slack under it, and "
                                      "sends the rest of a busy D to P; unset: no target")
    pd_prefill_ms_per_token: float = Field(
        0.04, gt=0, description="PD with an SLO: what one prompt token costs to compute (ms), a profiled figure "
        "(benchmarks/serving_compare.py --threshold-scan); 0.04 is tiny-llama on one core of this machine")
    max_beam_width: int = Field(8, ge=1, le=64, description="/infer_token: the widest beam search a request may "
                                "ask for")
    max_logits_floats: int = Field(1 << 24, gt=0, description="/infer_token: the most floats return_context_logits "
                                   "or return_generation_logits may return per request (4 bytes each); "
                                   "beyond it, a 400 before any work")
    enable_lora: bool = Field(False, description="serve LoRA adapters (vLLM's --enable-lora): the app gets a "
                              "LoraStore; lora_modules turns it on")
    lora_modules: str | None = Field(None, description="PEFT LoRA adapter directories served by name, "
                                     "'name=DIR,name2=DIR2' (vLLM's form); each name is a model id on /v1")
    max_loras: int = Field(8, gt=0, description="LoRA adapters each P, D or colocated replica keeps (least "
                           "recently used forgotten first)")
    max_lora_tasks: int = Field(64, gt=0, description="/infer_token: TensorRT-LLM task ids the app keeps the "
                                "adapter of; past them the oldest is forgotten and its id alone is refused")
    max_body_bytes: int = Field(4 << 20, gt=0, description="larger request bodies get a 413")
    api_key: SecretStr | None = Field(
        default_factory=lambda: SecretStr(os.environ["PDSERVE_API_KEY"]) if os.environ.get("PDSERVE_API_KEY") else None,
        description="when set, every model route needs 'Authorization: Bearer <key>' (Anthropic's routes also take "
                    "x-api-key); /health, /metrics, /openapi.json and /docs stay open. Default: the environment's "
                    "PDSERVE_API_KEY, else unset (vLLM's --api-key / VLLM_API_KEY)")
    embeddings: bool = Field(True, description="serve /v1/embeddings (all-MiniLM-L6-v2) in its own deployment")
    batch_dir: str = Field(
        default_factory=lambda: os.environ.get("PDSERVE_BATCH_DIR", "~/.pdserve/batches"),
        description="where /v1/files and /v1/batches keep their state (SQLite and the files' bytes); a path on "
        "storage every ingress replica reaches for a cluster (docs/operations.md). Default: the environment's "
        "PDSERVE_BATCH_DIR, else ~/.pdserve/batches")
    max_file_bytes: int = Field(200 << 20, gt=0, description="the largest file /v1/files stores (bytes)")
    max_batch_lines: int = Field(50000, gt=0, description="the most requests (lines) a batch input file may hold")
    batch_max_in_flight: int = Field(8, gt=0, description="batch lines each ingress replica keeps in flight at "
                                     "most; fewer while interactive requests wait (deployments/ingress/batch_runner.py)")
    batch_lease_s: float = Field(10.0, gt=0, description="seconds a batch stays with the ingress replica driving "
                                 "it after its last sign of life; then another replica (or its successor) goes on")
    rate_limits: RateLimits = Field(default_factory=RateLimits, description="per-key requests and tokens per "
                                    "minute (deployments/ingress/rate_limits.py); none by default")
    traces_exporter: Literal["none", "console"] = Field(
        "none", description="OpenTelemetry spans of each request: none, or console (the ingress's stdout)")

    @model_validator(mode="before")
    @classmethod
    def _tls_is_the_proxys(cls, args):
        """A key or certificate among the app's arguments: refused with where it goes. TLS is Ray
        Serve's proxy's (the config's ``http_options``), which the proxy reads before any app is built."""
        named = sorted(k for k in args if str(k) in TLS_OPTIONS) if isinstance(args, dict) else []
        if named:
            raise ValueError(f"{named[0]}: TLS is set in the Serve config's http_options (ssl_keyfile and "
                             "ssl_certfile, beside host and port), not among an application's args; see "
                             "configs/tls.yaml and docs/operations.md, \"HTTPS\"")
        return args

    @model_validator(mode="after")
    def _check(self) -> "_AppArgs":
        for field in ("model", "prefill_model", "decode_model"):
            setattr(self, field, _absolute_if_local(getattr(self, field)))
        self.engine_config()  # the engine's own checks of its settings (engine/config.py), each naming its field
        if self.lora_directories:  # a malformed lora_modules stops the build here
            self.enable_lora = True
        return self

    @property
    def lora_directories(self) -> dict[str, str]:
        """``lora_modules`` as {name: directory}."""
        out: dict[str, str] = {}
        for item in filter(None, (self.lora_modules or "").split(",")):
            name, sep, directory = item.strip().partition("=")
            if not sep or not name or not directory:
                raise ValueError(f"lora_modules: {item!r} is not name=DIR")
            if name in out:
                raise ValueError(f"lora_modules: {name!r} is named twice")
            out[name] = directory
        return out

    @property
    def disaggregation(self) -> DisaggregationPolicy:
        return DisaggregationPolicy(self.pd_local_prefill_tokens, self.pd_prefill_busy_tokens,
                                    self.pd_decode_prefix_reuse, self.slo_ttft_ms, self.slo_tpot_ms,
                                    self.pd_prefill_ms_per_token)

    @property
    def heartbeat_s(self) -> float:
        return self.stall_timeout_s / 4

    def engine_config(self, model: str | None = None) -> EngineConfig:
        """The engine settings of ``model`` (default: the app's): every engine setting the app takes."""
        return EngineConfig(model=model or self.model, **{spec.name: getattr(self, spec.name) for spec in app_settings()})


def _engine_arguments() -> dict:
    """AppArgs' engine settings, made from EngineConfig's fields (engine/config.py owns each one's
    type, default, description and bounds)."""
    types = typing.get_type_hints(EngineConfig)
    arguments = {}
    for spec in app_settings():
        bounds = {key: spec.metadata[key] for key in ("ge", "gt") if spec.metadata[key] is not None}
        arguments[spec.name] = (types[spec.name], Field(spec.default, description=spec.metadata["doc"], **bounds))
    return arguments


# The application's arguments: its own (above) and every engine setting an app may set.
AppArgs = create_model("AppArgs", __base__=_AppArgs, __module__=__name__, **_engine_arguments())


def _absolute_if_local(model: str | None) -> str | None:
    """A model path relative to where the app is built (``serve run``'s directory) made absolute,
    since the replicas run in other directories; names (tiny-llama, hub ids) pass unchanged."""
    if model in (None, TINY_LLAMA) or Path(model).is_absolute() or not Path(model).exists():
        return model
    return str(Path(model).resolve())
