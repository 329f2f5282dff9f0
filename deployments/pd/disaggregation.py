"""Where a PD request's prompt is computed: on P, which sends its KV to D, or on D itself.

Conditional disaggregation, as llm-d and Dynamo decide it, made per request before any work
(docs/serving.md, "Prefix-aware PD"). Without D's answer:

- ``short_prompt``: the prompt is at most ``local_prefill_tokens`` long: D computes it, without
  asking D anything first (a hand-off costs more than such a prompt does);
- ``remote``: D's prefix reuse is off: P computes every longer prompt;
- ``no_prefix_anywhere``: the router's prefix index says no D replica was sent any of the prompt's
  blocks, and P is not busy: P computes it, without the round trip to D that could only say
  "nothing held" (the index is this ingress's guess: another ingress may have sent D the prefix).

Otherwise D is asked first (``DecodeServer.plan``): how many of the prompt's leading tokens its
prefix cache holds (kept for the request), and its load. With that, of what D lacks (the rest):

- ``cached_prefix``: the rest is at most ``local_prefill_tokens``: D computes it;
- ``decode_busy``: such a short rest, but D is busy and P is not: P computes it (the reverse rule);
- ``prefill_busy``: P is busy and D is not: D computes the rest, however long;
- ``remote``: P computes the rest and sends only its KV (``kv_export_start``);
- ``no_plan``: the D replica asked gave no answer within ``stall_timeout_s`` (it is stalled):
  P computes the whole prompt, and the KV lease finds out whether a D takes it.

P is busy when this ingress has more than ``prefill_busy_tokens`` prompt tokens in flight per P
replica, or, with a TTFT target, when waiting behind them would push a rest that fits in the
target past it (``prefill_ms_per_token`` each: P computes one prompt's tokens after another's).
D is busy when it has requests waiting, or, with a TPOT target, when it is decoding and its
recent time per token plus the rest's prefill would pass the target: a local prefill delays every
decoding sequence's next token by its own time (DistServe's prefill-decode interference). D
holding 80% of its KV or more also keeps the long rests of ``prefill_busy`` off it.

- ``no_decode_replica`` (counted under where ``prefill_only``): no D replica answers
  (deployments/pd/decode_watch.py): P computes the prompt and decodes it too, as a colocated engine.
- ``no_prefill_replica`` (counted under where ``decode_only``): D answers but no P replica does: D
  computes the prompt too, as it does for a local prefill.

A failure never changes the decision: a request whose P or D fails migrates
(deployments/ingress/migration.py) and is decided again there.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_BUSY_KV_USAGE = 0.8  # above it, D is not given prompts P could compute
NO_PLAN = "no_plan"
NO_DECODE_REPLICA = "no_decode_replica"  # no D answers: P serves the whole request
NO_PREFILL_REPLICA = "no_prefill_replica"  # no P answers: D serves the whole request


@dataclass(frozen=True)
class Decision:
    local: bool  # D computes the prompt
    reason: str  # the rule that chose (module docstring), counted in /metrics


@dataclass(frozen=True)
class DecodeLoad:
    """What a D replica's plan says of its load (``DecodePlan``, deployments/replicas/servers.py)."""

    kv_usage: float = 0.0  # the fraction of its KV blocks held
    waiting: int = 0  # requests queued in its engine
    running: int = 0  # sequences it is decoding
    token_ms: float = 0.0  # recent time between two tokens of one of its streams; 0: none measured


@dataclass(frozen=True)
class DisaggregationPolicy:
    local_prefill_tokens: int  # prompts, or uncached rests, up to this long are computed on D
    prefill_busy_tokens: int  # P prompt tokens in flight per replica above which D computes prompts
    decode_prefix_reuse: bool  # ask D what it holds, and send only the rest
    slo_ttft_ms: float | None = None  # the app's targets (AppArgs); None: none
    slo_tpot_ms: float | None = None
    prefill_ms_per_token: float = 0.04  # a prompt token's compute time, on P or D (profiled)

    def without_plan(self, num_tokens: int, prefill_tokens_per_replica: float = 0.0,
                     prefix_anywhere: bool = True) -> Decision | None:
        """The decision for a prompt of ``num_tokens`` that needs nothing from D, else None (ask D).
        ``prefix_anywhere``: the router's index has one of D's replicas sent its first block."""
        if num_tokens <= self.local_prefill_tokens:
            return Decision(True, "short_prompt")
        if not self.decode_prefix_reuse:
            return Decision(False, "remote")
        if not prefix_anywhere and not self.prefill_busy(prefill_tokens_per_replica, num_tokens):
            return Decision(False, "no_prefix_anywhere")
        return None

    def decide(self, num_tokens: int, cached_tokens: int, decode: DecodeLoad,
               prefill_tokens_per_replica: float) -> Decision:
        """With D's answer: it holds ``cached_tokens`` of the prompt, its load is ``decode``; P has
        ``prefill_tokens_per_replica`` prompt tokens in flight from this ingress."""
        rest = num_tokens - cached_tokens
        p_busy = self.prefill_busy(prefill_tokens_per_replica, rest)
        d_busy = self.decode_busy(decode, rest)
        if rest <= self.local_prefill_tokens:  # D holds it whole (rest 0): D, whatever its load
            return Decision(False, "decode_busy") if d_busy and not p_busy and rest else Decision(True, "cached_prefix")
        if p_busy and not d_busy and decode.kv_usage < DECODE_BUSY_KV_USAGE:
            return Decision(True, "prefill_busy")
        return Decision(False, "remote")

    def prefill_busy(self, tokens_per_replica: float, rest: int) -> bool:
        """P has more in flight than its bound, or (TTFT target) what waits on P would push the
        rest past the target (a rest that misses it on its own misses it on D too: P keeps it)."""
        if tokens_per_replica > self.prefill_busy_tokens:
            return True
        if self.slo_ttft_ms is None:
            return False
        alone_ms = rest * self.prefill_ms_per_token
        return alone_ms <= self.slo_ttft_ms < alone_ms + tokens_per_replica * self.prefill_ms_per_token

    def decode_busy(self, decode: DecodeLoad, rest: int) -> bool:
        """D has a queue, or (TPOT target) computing ``rest`` would push its decoding sequences' next
        token past the target."""
        if decode.waiting > 0:
            return True
        return (self.slo_tpot_ms is not None and decode.running > 0
                and decode.token_ms + rest * self.prefill_ms_per_token > self.slo_tpot_ms)
