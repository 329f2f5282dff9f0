"""Application builders for ``serve run``.

    serve run deployments.app:build_pd_app                        # P and D apart, tiny-llama
    serve run deployments.app:build_colocated_app model=/models/x  # one engine deployment
    serve run configs/local.yaml                                   # what `make serve` runs
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.ingress import Ingress
from deployments.servers import DecodeServer, LLMServer, PrefillServer
from engine.loader import model_fingerprint, resolve_model_dir


def _args(args: AppArgs | dict | None) -> AppArgs:
    return args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})


def build_pd_app(args: AppArgs) -> Application:
    """Ingress -> PrefillServer, then DecodeServer, with the KV passed through the object store."""
    args = _args(args)
    prefill_model, decode_model = args.prefill_model or args.model, args.decode_model or args.model
    p_id, d_id = (model_fingerprint(resolve_model_dir(m)) for m in (prefill_model, decode_model))
    if p_id != d_id:
        raise ValueError(f"prefill_model / decode_model: P and D must serve the same model, since D continues "
                         f"from P's KV; got {prefill_model!r} and {decode_model!r}")
    options = dict(max_ongoing_requests=args.max_ongoing_requests)
    prefill = PrefillServer.options(**options).bind(args.engine_config(prefill_model))
    decode = DecodeServer.options(**options).bind(args.engine_config(decode_model))
    return Ingress.bind(args, prefill=prefill, decode=decode)


def build_colocated_app(args: AppArgs) -> Application:
    """Ingress -> LLMServer: prefill and decode in one engine."""
    args = _args(args)
    resolve_model_dir(args.model)
    llm = LLMServer.options(max_ongoing_requests=args.max_ongoing_requests).bind(args.engine_config())
    return Ingress.bind(args, llm=llm)
