"""P and D scale on their own signals (Ray Serve custom autoscaling policies).

Each replica reports its load (``record_autoscaling_stats``, deployments/replicas/servers.py): P its
prompt tokens still to compute, D the requests it runs or queues and the fraction of its KV blocks
held. The policies turn the deployment's totals into a replica count; Ray Serve applies the
``autoscaling_config``'s min/max replicas and up/down-scale delays around them. In a serve config:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      policy:
        policy_function: deployments.replicas.autoscaling:PrefillScaling
        policy_kwargs: {target_queued_prompt_tokens: 4096}

``configs/pd-autoscale.yaml`` sets both; ``pdserve-loadtest --sample-replicas`` reports the P:D
replica ratio over a run.

``PrefillRateScaling`` and ``DecodeRateScaling`` size P and D from the rates the replicas measure
(prompt tokens computed, prompts asked for, output tokens sent per second: LoadMeter, deployments/
load_meter.py) against the app's TTFT and TPOT targets, as Dynamo's planner in SLA mode does: the
math is deployments/pd/pd_planner.py, these are its Serve wrappers.
"""

from __future__ import annotations

import math

from ray.serve.config import AutoscalingContext

from deployments.pd import pd_planner


def _total(ctx: AutoscalingContext, name: str) -> float | None:
    """The deployment's total of a reported figure (each replica's average over the look-back
    period); None before any replica has reported it."""
    per_replica = (ctx.aggregated_metrics or {}).get(name)
    return sum(per_replica.values()) if per_replica else None


class PrefillScaling:
    """Enough P replicas that each has ``target_queued_prompt_tokens`` prompt tokens to compute."""

    def __init__(self, target_queued_prompt_tokens: float = 4096) -> None:
        if target_queued_prompt_tokens <= 0:
            raise ValueError("target_queued_prompt_tokens: must be > 0")
        self.target = target_queued_prompt_tokens

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        queued = _total(ctx, "queued_prompt_tokens")
        if queued is None:
            return ctx.target_num_replicas, {}
        return math.ceil(queued / self.target), {}


class DecodeScaling:
    """Enough D replicas that each runs or queues at most ``target_requests`` requests and holds
    at most ``target_kv_usage`` of its KV blocks, whichever needs more."""

    def __init__(self, target_requests: float = 32, target_kv_usage: float = 0.7) -> None:
        if target_requests <= 0 or not 0 < target_kv_usage <= 1:
            raise ValueError("target_requests: must be > 0; target_kv_usage: must be in (0, 1]")
        self.target_requests, self.target_kv_usage = target_requests, target_kv_usage

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        requests, kv_usage = _total(ctx, "requests"), _total(ctx, "kv_usage")
        if requests is None or kv_usage is None:
            return ctx.target_num_replicas, {}
        return max(math.ceil(requests / self.target_requests), math.ceil(kv_usage / self.target_kv_usage)), {}


class PrefillRateScaling:
    """P replicas for the prompt tokens per second measured over the look-back window and the
    prompt tokens queued, each replica at the utilisation that keeps the mean TTFT within
    ``slo_ttft_ms`` (pd_planner.prefill_replicas)."""

    def __init__(self, slo_ttft_ms: float, prefill_ms_per_token: float, interval_s: float = 10.0) -> None:
        if slo_ttft_ms <= 0 or prefill_ms_per_token <= 0 or interval_s <= 0:
            raise ValueError("slo_ttft_ms, prefill_ms_per_token, interval_s: must be > 0")
        self.slo_ttft_ms, self.prefill_ms_per_token, self.interval_s = slo_ttft_ms, prefill_ms_per_token, interval_s

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        tokens, prompts = _total(ctx, "prompt_tokens_per_s"), _total(ctx, "prompts_per_s")
        queued = _total(ctx, "queued_prompt_tokens")
        if tokens is None or prompts is None or queued is None:
            return ctx.target_num_replicas, {}
        return pd_planner.prefill_replicas(self.prefill_ms_per_token, self.slo_ttft_ms, tokens, prompts, queued,
                                           self.interval_s), {}


class DecodeRateScaling:
    """D replicas for the output tokens per second measured over the look-back window, or for the
    requests running and queued, at the largest batch whose step meets ``slo_tpot_ms``, corrected
    by the time per token the replicas measured against the profile's (pd_planner.decode_replicas,
    decode_correction)."""

    def __init__(self, slo_tpot_ms: float, decode_step_ms: float, decode_ms_per_sequence: float) -> None:
        if slo_tpot_ms <= 0:
            raise ValueError("slo_tpot_ms: must be > 0")
        self.profile = pd_planner.DecodeProfile(decode_step_ms, decode_ms_per_sequence)
        self.slo_tpot_ms = slo_tpot_ms

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        tokens, requests = _total(ctx, "output_tokens_per_s"), _total(ctx, "requests")
        if tokens is None or requests is None:
            return ctx.target_num_replicas, {}
        # The replicas that measured a time per token (0: no stream sent two batches in 2 s).
        measured = [ms for ms in ((ctx.aggregated_metrics or {}).get("token_ms") or {}).values() if ms > 0]
        token_ms = sum(measured) / len(measured) if measured else 0.0  # 0: no correction
        correction = pd_planner.decode_correction(self.profile, token_ms,
                                                  requests / len(ctx.aggregated_metrics["requests"]))
        return pd_planner.decode_replicas(self.profile, self.slo_tpot_ms / correction, tokens, requests), {}
