"""Rate-matched P:D: how many P and D replicas the measured rates need to meet the SLO targets.

The math of Dynamo's planner in SLA mode (its "throughput-based scaling"), with DistServe's
queueing model for P, pure functions over numbers: the Serve policies (deployments/replicas/autoscaling.py)
and the trace replay (benchmarks/pd_planner.py) call them.

- **P.** A P replica computes one prompt's tokens after another's at ``prefill_ms_per_token``
  (prefill is compute-bound: a batch of prompts takes as long as their tokens one by one). Prompts
  of ``isl`` tokens arriving at random make an M/D/1 queue (DistServe, section 4): the mean time
  to first token is ``D + rho * D / (2 * (1 - rho))`` with ``D`` one prompt's compute time and
  ``rho`` the replica's utilisation. The highest ``rho`` whose TTFT meets the target is
  ``2 (T - D) / (2T - D)``; a replica's prompt tokens per second at the target are that fraction
  of ``1000 / prefill_ms_per_token``. Replicas: the load over the next interval (the rate
  measured over the look-back window, as Dynamo's constant predictor, plus the queued prompt
  tokens to clear within ``interval_s``) over that capacity.
- **D.** A D replica's decode step with ``b`` sequences takes ``decode_step_ms + b *
  decode_ms_per_sequence`` and makes one token for each: the largest batch whose step meets the
  TPOT target is ``b_max``, a replica's tokens per second at the target ``b_max * 1000 / step``.
  Replicas: the output tokens per second measured over that, or the sequences it runs and queues
  over ``b_max``, whichever needs more (the rate says what is asked; the sequences say what waits
  when the measured rate is already D's ceiling). As in Dynamo, the TPOT target is first divided
  by a correction factor, D's measured time per token over the profile's at the batch it ran.

The per-token and per-step costs are profiled (Dynamo's planner reads them from a profiling run;
``benchmarks/pd_planner.py`` names where this machine's come from), not measured live.
"""

from __future__ import annotations

from dataclasses import dataclass
import math

# A TTFT target below one prompt's compute time cannot be met by more replicas: the planner then
# sizes P for this utilisation, where the queue's wait is half a prompt's time.
UNREACHABLE_TTFT_UTILISATION = 0.5


@dataclass(frozen=True)
class DecodeProfile:
    """A D replica's decode step, profiled: ``step_ms + batch * ms_per_sequence``."""

    step_ms: float  # the fixed part
    ms_per_sequence: float  # what each sequence in the batch adds

    def __post_init__(self) -> None:
        if self.step_ms < 0 or self.ms_per_sequence <= 0:
            raise ValueError("decode_step_ms: must be >= 0; decode_ms_per_sequence: must be > 0")


def prefill_capacity(prefill_ms_per_token: float, isl: float, slo_ttft_ms: float) -> float:
    """Prompt tokens per second one P replica computes with a mean TTFT at ``slo_ttft_ms``, for
    prompts of ``isl`` computed tokens (M/D/1)."""
    service_ms = isl * prefill_ms_per_token
    if service_ms >= slo_ttft_ms:
        utilisation = UNREACHABLE_TTFT_UTILISATION
    else:
        utilisation = 2 * (slo_ttft_ms - service_ms) / (2 * slo_ttft_ms - service_ms)
    return utilisation * 1000 / prefill_ms_per_token


def decode_batch(profile: DecodeProfile, slo_tpot_ms: float) -> int:
    """The most sequences a D replica decodes with each step within ``slo_tpot_ms`` (at least 1)."""
    return max(1, math.floor((slo_tpot_ms - profile.step_ms) / profile.ms_per_sequence))


def decode_capacity(profile: DecodeProfile, slo_tpot_ms: float) -> float:
    """Output tokens per second one D replica makes at its largest batch within the target."""
    batch = decode_batch(profile, slo_tpot_ms)
    return batch * 1000 / (profile.step_ms + batch * profile.ms_per_sequence)


def prefill_replicas(prefill_ms_per_token: float, slo_ttft_ms: float, prompt_tokens_per_s: float, prompts_per_s: float,
                     queued_prompt_tokens: float, interval_s: float) -> int:
    """P replicas for the measured prompt tokens per second (and prompts per second: their mean
    length sets the queueing), plus the queued tokens cleared within ``interval_s``."""
    isl = prompt_tokens_per_s / prompts_per_s if prompts_per_s > 0 else 0.0
    load = prompt_tokens_per_s + queued_prompt_tokens / interval_s
    return _whole(load / prefill_capacity(prefill_ms_per_token, isl, slo_ttft_ms))


def decode_correction(profile: DecodeProfile, token_ms: float, sequences_per_replica: float) -> float:
    """Dynamo's decode correction factor: the time per token D measured over the one the profile
    expects at the batch it ran (1 when nothing was measured). The planner divides the TPOT target
    by it: a D slower than its profile is given smaller batches, so more replicas."""
    if token_ms <= 0 or sequences_per_replica <= 0:
        return 1.0
    return token_ms / (profile.step_ms + sequences_per_replica * profile.ms_per_sequence)


def decode_replicas(profile: DecodeProfile, slo_tpot_ms: float, output_tokens_per_s: float, sequences: float) -> int:
    """D replicas for the measured output tokens per second, or for the sequences running and
    queued, whichever needs more."""
    return max(_whole(output_tokens_per_s / decode_capacity(profile, slo_tpot_ms)),
               _whole(sequences / decode_batch(profile, slo_tpot_ms)))


def _whole(replicas: float) -> int:
    """Replicas rounded up, but not for float noise (3.0000000001 is 3)."""
    return math.ceil(round(replicas, 6))
