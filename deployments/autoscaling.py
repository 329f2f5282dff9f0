"""P and D scale on their own signals (Ray Serve custom autoscaling policies).

Each replica reports its load (``record_autoscaling_stats``, deployments/servers.py): P its
prompt tokens still to compute, D the requests it runs or queues and the fraction of its KV blocks
held. The policies turn the deployment's totals into a replica count; Ray Serve applies the
``autoscaling_config``'s min/max replicas and up/down-scale delays around them. In a serve config:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      policy:
        policy_function: deployments.autoscaling:PrefillScaling
        policy_kwargs: {target_queued_prompt_tokens: 4096}

``configs/pd-autoscale.yaml`` sets both; ``pdserve-loadtest --sample-replicas`` reports the P:D
replica ratio over a run.
"""

from __future__ import annotations

import math

from ray.serve.config import AutoscalingContext


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
