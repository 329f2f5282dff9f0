"""Application builders for ``serve run``.

    serve run deployments.app:build_pd_app                        # P and D apart, tiny-llama
    serve run deployments.app:build_colocated_app model=/models/x  # one engine deployment
    serve run configs/local.yaml                                   # what `make serve` runs
"""

from __future__ import annotations

from dataclasses import replace

from ray.serve import Application

from deployments.ingress.admission import serve_max_ongoing
from deployments.config import AppArgs
from deployments.ingress.ingress import Ingress
from deployments.replicas.embeddings import EmbeddingServer
from deployments.pd.kv_connector import make_kv_connector
from deployments.replicas.lora_store import LoraStore
from deployments.replicas.prefix_store import PrefixStoreServer
from deployments.replicas.servers import DecodeServer, LLMServer, PrefillServer
from engine.execution.loader import model_fingerprint, resolve_model_dir


def _args(args: AppArgs | dict | None) -> AppArgs:
    return args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})


def build_pd_app(args: AppArgs) -> Application:
    """Ingress -> PrefillServer, then DecodeServer, with the KV passed by the app's ``kv_transport``."""
    return pd_app(args)


def build_colocated_app(args: AppArgs) -> Application:
    """Ingress -> LLMServer: prefill and decode in one engine."""
    return colocated_app(args)


def pd_app(args: AppArgs | dict | None = None, prefill_options: dict | None = None,
           decode_options: dict | None = None, decode_engine: dict | None = None) -> Application:
    """``build_pd_app`` for Python callers, with deployment options for P and D (the keys a
    serve config's ``deployments:`` section sets: ray_actor_options, autoscaling_config, ...) and
    ``decode_engine``: EngineConfig fields D's engine takes instead of the app's (a D of another
    build, as in a rolling upgrade: deployments/pd/compatibility.py pairs only what may be paired).
    Ray Serve calls builders with one argument, hence two functions."""
    args = _args(args)
    prefill_model, decode_model = args.prefill_model or args.model, args.decode_model or args.model
    p_id, d_id = (model_fingerprint(resolve_model_dir(m)) for m in (prefill_model, decode_model))
    if p_id != d_id:
        raise ValueError(f"prefill_model / decode_model: P and D must serve the same model, since D continues "
                         f"from P's KV; got {prefill_model!r} and {decode_model!r}")
    options = dict(max_ongoing_requests=serve_max_ongoing(args.max_ongoing_requests))
    store = _lora_store(args)
    prefill = PrefillServer.options(**{**options, **(prefill_options or {})})
    kv = make_kv_connector(args.kv_transport, args.kv_lease_s)
    prefix_store = PrefixStoreServer.bind(args.prefix_store_mib * 2**20) if args.prefix_store_mib else None
    prefill = prefill.bind(args.engine_config(prefill_model), store, args.max_loras, args.heartbeat_s,
                           args.step_timeout_s, kv, prefix_store)
    decode = DecodeServer.options(**{**options, **(decode_options or {})})
    decode_config = replace(args.engine_config(decode_model), first_token_from_prefill=True, **(decode_engine or {}))
    decode = decode.bind(decode_config, store, args.max_loras, args.heartbeat_s, args.step_timeout_s, args.kv_lease_s,
                         kv)
    return Ingress.bind(args, lora_store=store, prefill=prefill, decode=decode, embedder=_embedder(args))


def colocated_app(args: AppArgs | dict | None = None, llm_options: dict | None = None) -> Application:
    """``build_colocated_app`` for Python callers, with deployment options for the engine."""
    args = _args(args)
    resolve_model_dir(args.model)
    options = dict(max_ongoing_requests=serve_max_ongoing(args.max_ongoing_requests), **(llm_options or {}))
    store = _lora_store(args)
    llm = LLMServer.options(**options).bind(args.engine_config(), store, args.max_loras, args.heartbeat_s,
                                            args.step_timeout_s)
    return Ingress.bind(args, lora_store=store, llm=llm, embedder=_embedder(args))


def _embedder(args: AppArgs):
    return EmbeddingServer.bind() if args.embeddings else None


def _lora_store(args: AppArgs):
    """The app's LoRA adapters (deployments/replicas/lora_store.py), shared by every engine replica; none
    without enable_lora (one process fewer, and LoRA fields are refused)."""
    if not args.enable_lora:
        return None
    return LoraStore.bind(args.model, args.lora_directories, args.max_lora_rank, args.max_lora_tasks)
