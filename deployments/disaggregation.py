"""Where a PD request's prompt is computed: on P, which sends its KV to D, or on D itself.

Conditional disaggregation, as llm-d and Dynamo decide it, made per request before any work
(docs/serving.md, "Prefix-aware PD"):

- ``short_prompt``: the prompt is at most ``local_prefill_tokens`` long: D computes it, without
  asking D anything first (a hand-off costs more than such a prompt does);
- otherwise D is asked first (``DecodeServer.plan``): how many of the prompt's leading tokens its
  prefix cache holds (kept for the request), and its load;
- ``cached_prefix``: what D lacks is at most ``local_prefill_tokens``: D computes it;
- ``prefill_busy``: P has more than ``prefill_busy_tokens`` prompt tokens in flight from this
  ingress per P replica, while D holds less than ``DECODE_BUSY_KV_USAGE`` of its KV: D computes it;
- ``remote``: P computes what D lacks and sends only that KV (``kv_export_start``);
- ``no_plan``: the D replica asked gave no answer within ``stall_timeout_s`` (it is stalled):
  P computes the whole prompt, and the KV lease finds out whether a D takes it.

A failure never changes the decision: a request whose P or D fails migrates
(deployments/migration.py) and is decided again there.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_BUSY_KV_USAGE = 0.8  # above it, D is not given prompts P could compute
NO_PLAN = "no_plan"


@dataclass(frozen=True)
class Decision:
    local: bool  # D computes the prompt
    reason: str  # short_prompt, cached_prefix, prefill_busy, remote or no_plan


@dataclass(frozen=True)
class DisaggregationPolicy:
    local_prefill_tokens: int  # prompts, or uncached rests, up to this long are computed on D
    prefill_busy_tokens: int  # P prompt tokens in flight per replica above which D computes prompts
    decode_prefix_reuse: bool  # ask D what it holds, and send only the rest

    def without_plan(self, num_tokens: int) -> Decision | None:
        """The decision for a prompt of ``num_tokens`` that needs nothing from D, else None."""
        if num_tokens <= self.local_prefill_tokens:
            return Decision(True, "short_prompt")
        if not self.decode_prefix_reuse:
            return Decision(False, "remote")
        return None

    def decide(self, num_tokens: int, cached_tokens: int, decode_kv_usage: float,
               prefill_tokens_per_replica: float) -> Decision:
        """With D's answer: it holds ``cached_tokens`` of the prompt, and uses ``decode_kv_usage``
        of its KV; P has ``prefill_tokens_per_replica`` prompt tokens in flight from this ingress."""
        if num_tokens - cached_tokens <= self.local_prefill_tokens:
            return Decision(True, "cached_prefix")
        if prefill_tokens_per_replica > self.prefill_busy_tokens and decode_kv_usage < DECODE_BUSY_KV_USAGE:
            return Decision(True, "prefill_busy")
        return Decision(False, "remote")
