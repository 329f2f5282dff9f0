"""Rate-matched P:D (deployments/pd/pd_planner.py, the Serve policies in deployments/replicas/autoscaling.py):
the planner's decisions on a short recorded trace of what the replicas report, each worked out
by hand; the replicas report what the policies read; the trace replay of benchmarks/pd_planner.py.
In-process: the policies get AutoscalingContext-like inputs, as test_app_config gives the others."""

from types import SimpleNamespace

import pytest

from benchmarks import pd_planner as replay
from deployments.pd import pd_planner
from deployments.replicas import servers
from deployments.replicas.autoscaling import DecodeRateScaling, DecodeScaling, PrefillRateScaling, PrefillScaling
from deployments.replicas.load_meter import LoadMeter
from engine.outputs import RequestOutput

# P: 0.1 ms a prompt token, TTFT 500 ms. D: a step is 10 ms + 0.5 ms a sequence, TPOT 50 ms:
# 80 sequences a step at most, 80 * 1000 / 50 = 1600 tokens/s a replica.
PREFILL = PrefillRateScaling(slo_ttft_ms=500, prefill_ms_per_token=0.1, interval_s=10)
DECODE = DecodeRateScaling(slo_tpot_ms=50, decode_step_ms=10, decode_ms_per_sequence=0.5)

# Each interval: what P's two replicas (a, b) and D's two (x, y) reported, averaged over the
# look-back window, and the replicas the policies must choose.
TRACE = [
    # Quiet. 1,000-token prompts: 100 ms each, M/D/1 at TTFT 500: utilisation 2 * 400 / 900,
    # 8,889 tokens/s a replica; 3,000 tokens/s -> 1. D: 800 tokens/s of 1,600, 15 of 80 sequences -> 1.
    ({"prompt_tokens_per_s": {"a": 2000, "b": 1000}, "prompts_per_s": {"a": 2, "b": 1},
      "queued_prompt_tokens": {"a": 0, "b": 0}},
     {"output_tokens_per_s": {"x": 500, "y": 300}, "requests": {"x": 10, "y": 5}}, (1, 1)),
    # A burst: 17,000 tokens/s and 30,000 queued, cleared within the 10 s interval: 20,000 / 8,889
    # -> 3. D: 2,900 / 1,600 -> 2; 130 sequences / 80 -> 2.
    ({"prompt_tokens_per_s": {"a": 9000, "b": 8000}, "prompts_per_s": {"a": 9, "b": 8},
      "queued_prompt_tokens": {"a": 20000, "b": 10000}},
     {"output_tokens_per_s": {"x": 1500, "y": 1400}, "requests": {"x": 70, "y": 60}}, (3, 2)),
    # Long answers: 200-token prompts (20 ms, utilisation 2 * 480 / 980: 9,796 tokens/s), 4,000/s
    # -> 1. D makes 3,000 tokens/s (-> 2) but runs and queues 300 sequences: 300 / 80 -> 4.
    ({"prompt_tokens_per_s": {"a": 2000, "b": 2000}, "prompts_per_s": {"a": 10, "b": 10},
      "queued_prompt_tokens": {"a": 0, "b": 0}},
     {"output_tokens_per_s": {"x": 1500, "y": 1500}, "requests": {"x": 150, "y": 150}}, (1, 4)),
    # 6,000-token prompts: 600 ms, past the 500 ms target whatever P does: P is sized at half
    # load, 5,000 tokens/s a replica: 12,000 -> 3. D idle -> 0 (Serve keeps min_replicas).
    ({"prompt_tokens_per_s": {"a": 6000, "b": 6000}, "prompts_per_s": {"a": 1, "b": 1},
      "queued_prompt_tokens": {"a": 0, "b": 0}},
     {"output_tokens_per_s": {"x": 0, "y": 0}, "requests": {"x": 0, "y": 0}}, (3, 0)),
    # Only a queue (no prompt finished in the window): 50,000 tokens over 10 s at full speed,
    # 10,000 tokens/s a replica -> 1 (0.5 rounded up).
    ({"prompt_tokens_per_s": {"a": 0}, "prompts_per_s": {"a": 0}, "queued_prompt_tokens": {"a": 50000}},
     {"output_tokens_per_s": {"x": 3200}, "requests": {"x": 80}}, (1, 2)),
    # D runs slower than its profile: 60 ms a token measured (y measured none: left out) where 40
    # sequences a replica should take 10 + 20 = 30. The correction, 2, halves the target to 25 ms:
    # 30 sequences a step, 1,200 tokens/s a replica. 2,400 tokens/s -> 2; 80 sequences / 30 -> 3.
    ({"prompt_tokens_per_s": {"a": 1000}, "prompts_per_s": {"a": 1}, "queued_prompt_tokens": {"a": 0}},
     {"output_tokens_per_s": {"x": 1200, "y": 1200}, "requests": {"x": 40, "y": 40},
      "token_ms": {"x": 60.0, "y": 0.0}}, (1, 3)),
    # A replica has not reported the rates yet: no change (the context's target, 2).
    ({"queued_prompt_tokens": {"a": 50000}}, {"requests": {"x": 80}}, (2, 2)),
]


def ctx(metrics: dict) -> SimpleNamespace:
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=2)


def test_the_planner_sizes_p_and_d_on_a_recorded_trace():
    chosen = [(PREFILL(ctx(p))[0], DECODE(ctx(d))[0]) for p, d, _ in TRACE]
    assert chosen == [want for _, _, want in TRACE]


def test_the_policies_read_what_the_replicas_report():
    now = [0.0]
    meter = LoadMeter(clock=lambda: now[0])
    meter.rates(0)
    now[0], meter.prompts, meter.tokens_sent = 10.0, 10, 4000
    reported = {**meter.rates(10000), "queued_prompt_tokens": 0, "requests": 40}  # and servers.load's
    metrics = {name: {"a": value} for name, value in reported.items()}
    assert (PREFILL(ctx(metrics))[0], DECODE(ctx(metrics))[0]) == (1, 1)  # not "no report yet" (2, 2)


def test_a_replicas_report_feeds_the_threshold_and_the_rate_policies():
    """``record_autoscaling_stats`` of a P and a D replica (an engine's stats stood in for), as
    Serve gets it: every policy of the role finds its figures (none answers "no report yet")."""
    stats = SimpleNamespace(running=3, waiting_by_priority={1: 1, 5: 0}, kv_cache_usage=0.5,
                            prompt_tokens_computed=0, queued_prompt_tokens=9000)

    now = [0.0]

    def replica(deployment):
        server = object.__new__(deployment.func_or_class)  # the class Serve runs, without its engine
        server.engine = SimpleNamespace(stats=lambda: stats, shutdown=lambda: None)
        server.meter = LoadMeter(clock=lambda: now[0])
        server.record_autoscaling_stats()  # the first report's rates are 0: the second's are measured
        return server

    p, d = replica(servers.PrefillServer), replica(servers.DecodeServer)
    previous = d.meter.sent([RequestOutput("r", [7], "", 1, False, None, 0)], None)
    now[0] += 0.1
    d.meter.sent([RequestOutput("r", [8], "", 2, False, None, 0)], previous)  # a token 100 ms after the last
    p, d = ({name: {"r": value} for name, value in r.record_autoscaling_stats().items()} for r in (p, d))
    assert PrefillScaling()(ctx(p))[0] == 3  # 9,000 queued / 4,096
    assert PREFILL(ctx(p))[0] == 1  # 9,000 queued over 10 s
    assert DecodeScaling(target_requests=2)(ctx(d))[0] == 2  # 4 requests / 2
    # 100 ms a token where the profile says 10 + 4 * 0.5 = 12: the target shrinks to 6 ms, below
    # a step: one sequence a replica, 4 replicas (1 as profiled).
    assert DECODE(ctx(d))[0] == 4


def test_the_queueing_model_and_the_decode_batch():
    # M/D/1: the mean TTFT at the capacity's utilisation is the target.
    service_ms, target = 100.0, 500.0
    utilisation = pd_planner.prefill_capacity(0.1, 1000, target) * 0.1 / 1000
    assert service_ms + utilisation * service_ms / (2 * (1 - utilisation)) == pytest.approx(target)
    profile = pd_planner.DecodeProfile(step_ms=10, ms_per_sequence=0.5)
    assert pd_planner.decode_batch(profile, 50) == 80
    assert pd_planner.decode_batch(profile, 9) == 1  # the target is below one step: one at a time
    assert pd_planner.decode_capacity(profile, 50) == pytest.approx(1600)
    assert pd_planner.decode_replicas(profile, 50, 3200, 0) == 2  # exactly two replicas' worth
    with pytest.raises(ValueError, match="decode_ms_per_sequence"):
        pd_planner.DecodeProfile(step_ms=10, ms_per_sequence=0)
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        PrefillRateScaling(slo_ttft_ms=0, prefill_ms_per_token=0.1)


def test_the_replay_of_a_bursty_trace():
    args = replay.parser().parse_args(["--duration-s", "900"])
    requests = replay.trace(args.seed, args.duration_s)
    assert requests == replay.trace(args.seed, args.duration_s)  # the seed makes the trace
    intervals = replay.replay(requests, args)
    result = replay.summary(intervals, args)
    assert len({(i.p_replicas, i.d_replicas) for i in intervals}) > 3  # the split moves with the load
    # After an interval P could not keep up with, it asks for more than that interval's load
    # alone needs: the queue left over is cleared too.
    assert any(after.p_replicas > before.p_needed > before.p_replicas
               for before, after in zip(intervals, intervals[1:]))
    assert result["planner_replica_s"] < result["fixed_same_share_replica_s"]
    assert result["fixed_same_share_replica_s"] <= result["fixed_every_interval_replica_s"]
