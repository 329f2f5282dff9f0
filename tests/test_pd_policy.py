"""PD's conditional-disaggregation policy (deployments/pd/disaggregation.py) as a table: each row is
its inputs and the decision and reason it must give, with and without the app's TTFT/TPOT
targets; the SLO arguments as the app takes them; D's time per token as its LoadMeter measures
it; the router's "sent anywhere" answer. In-process, no Ray."""

import pydantic
import pytest

from deployments.pd import routing
from deployments.config import AppArgs
from deployments.pd.disaggregation import DecodeLoad, DisaggregationPolicy
from deployments.replicas.load_meter import TOKEN_WINDOW_S, LoadMeter
from engine.outputs import RequestOutput
from engine.request import GenerationRequest
from sampling import SamplingParams

MS = 0.04  # prefill_ms_per_token in every row: a 1000-token prompt is 40 ms, a 120-token rest 4.8 ms


def policy(ttft=None, tpot=None, reuse=True) -> DisaggregationPolicy:
    return DisaggregationPolicy(local_prefill_tokens=128, prefill_busy_tokens=16384, decode_prefix_reuse=reuse,
                                slo_ttft_ms=ttft, slo_tpot_ms=tpot, prefill_ms_per_token=MS)


# (policy, prompt tokens, P tokens in flight per replica, sent anywhere) -> decision, or None: ask D
WITHOUT_PLAN = [
    (policy(), 100, 0, False, (True, "short_prompt")),
    (policy(), 128, 0, True, (True, "short_prompt")),
    (policy(reuse=False), 129, 0, True, (False, "remote")),
    (policy(), 1000, 0, False, (False, "no_prefix_anywhere")),  # D holds none of it: no round trip
    (policy(), 1000, 0, True, None),  # D may hold some: ask
    (policy(), 1000, 20000, False, None),  # P busy: D may take it whole (prefill_busy), ask
    (policy(ttft=100), 1000, 1600, False, None),  # 40 ms alone, 104 behind P's queue: P busy, ask D
    (policy(ttft=100), 1000, 1400, False, (False, "no_prefix_anywhere")),  # 96 ms: P meets the target
    (policy(ttft=30), 1000, 1500, False, (False, "no_prefix_anywhere")),  # misses 30 ms alone: P keeps it
]


@pytest.mark.parametrize("rule, num_tokens, p_load, anywhere, want", WITHOUT_PLAN)
def test_without_a_plan(rule, num_tokens, p_load, anywhere, want):
    decision = rule.without_plan(num_tokens, p_load, anywhere)
    assert (decision.local, decision.reason) == want if want else decision is None


IDLE = DecodeLoad()
# (policy, prompt tokens, tokens D holds, D's load, P tokens in flight per replica) -> decision
WITH_PLAN = [
    (policy(), 1000, 880, IDLE, 0, (True, "cached_prefix")),
    (policy(), 1000, 864, IDLE, 0, (False, "remote")),  # 136 tokens lacking: past 128
    (policy(), 1000, 0, DecodeLoad(kv_usage=0.5), 20000, (True, "prefill_busy")),
    (policy(), 1000, 0, DecodeLoad(kv_usage=0.9), 20000, (False, "remote")),  # D's KV nearly full
    (policy(), 1000, 0, DecodeLoad(waiting=1), 20000, (False, "remote")),  # D queues: not given P's work
    # The reverse rule: D busy (it queues), P idle: P computes even a cached rest.
    (policy(), 1000, 880, DecodeLoad(waiting=2), 0, (False, "decode_busy")),
    (policy(), 1000, 880, DecodeLoad(waiting=2), 20000, (True, "cached_prefix")),  # both busy: no hand-off
    (policy(), 1008, 1008, DecodeLoad(waiting=2), 0, (True, "cached_prefix")),  # D holds it all
    # TPOT 30 ms: D decoding at 20 ms a token has 10 ms of slack, the 120-token rest takes 4.8.
    (policy(tpot=30), 1000, 880, DecodeLoad(running=8, token_ms=20), 0, (True, "cached_prefix")),
    (policy(tpot=30), 1000, 880, DecodeLoad(running=8, token_ms=26), 0, (False, "decode_busy")),  # 30.8 ms
    (policy(tpot=30), 1000, 880, DecodeLoad(running=0, token_ms=26), 0, (True, "cached_prefix")),  # none to delay
    (policy(), 1000, 880, DecodeLoad(running=8, token_ms=26), 0, (True, "cached_prefix")),  # no target
    # P busy, D has room but not for a 40 ms prefill under a 30 ms TPOT: P keeps the prompt.
    (policy(tpot=30), 1000, 0, DecodeLoad(running=8, token_ms=5), 20000, (False, "remote")),
    (policy(tpot=50), 1000, 0, DecodeLoad(running=8, token_ms=5), 20000, (True, "prefill_busy")),
    # TTFT 100 ms: P is busy when its queue pushes the rest past it.
    (policy(ttft=100), 1000, 880, DecodeLoad(waiting=2), 2000, (False, "decode_busy")),  # 80 + 4.8 ms
    (policy(ttft=100), 1000, 880, DecodeLoad(waiting=2), 2400, (True, "cached_prefix")),  # 96 + 4.8 ms
    (policy(ttft=100), 1000, 0, DecodeLoad(kv_usage=0.1), 1600, (True, "prefill_busy")),  # 64 + 40 ms
    (policy(ttft=100), 1000, 0, DecodeLoad(kv_usage=0.1), 1400, (False, "remote")),  # 56 + 40 ms
    (policy(ttft=30), 1000, 0, DecodeLoad(kv_usage=0.1), 1600, (False, "remote")),  # 40 ms alone: a miss anyway
]


@pytest.mark.parametrize("rule, num_tokens, cached, load, p_load, want", WITH_PLAN)
def test_with_ds_plan(rule, num_tokens, cached, load, p_load, want):
    decision = rule.decide(num_tokens, cached, load, p_load)
    assert (decision.local, decision.reason) == want


def test_the_app_carries_its_slo_targets_into_the_policy_and_refuses_bad_ones():
    args = AppArgs(slo_ttft_ms="2000", slo_tpot_ms="50", pd_prefill_ms_per_token="0.1")  # as serve run passes them
    assert (args.disaggregation.slo_ttft_ms, args.disaggregation.slo_tpot_ms) == (2000, 50)
    assert args.disaggregation.prefill_ms_per_token == 0.1
    assert AppArgs().disaggregation.slo_tpot_ms is None
    for field, value in (("slo_ttft_ms", 0), ("slo_tpot_ms", -5), ("slo_tpot_ms", "fast"),
                         ("pd_prefill_ms_per_token", 0)):
        with pytest.raises(pydantic.ValidationError, match=field):
            AppArgs(**{field: value})


def output(index: int, tokens: int = 1) -> RequestOutput:
    return RequestOutput("r", [7] * tokens, "", 1, False, None, 0, index=index)


def test_d_measures_its_time_per_token_from_its_streams_batches():
    now = [100.0]
    meter = LoadMeter(clock=lambda: now[0])
    first = meter.sent([output(0)], None)  # the stream's first batch: its wait is no step
    assert meter.token_ms() == 0.0
    now[0] += 0.030
    previous = meter.sent([output(0), output(1)], first)  # one step of two choices, 30 ms later
    now[0] += 0.060
    meter.sent([output(0), output(1), output(0), output(1)], previous)  # two steps in 60 ms
    assert meter.token_ms() == pytest.approx(30.0)
    assert meter.tokens_sent == 7
    now[0] += TOKEN_WINDOW_S + 0.01
    assert meter.token_ms() == 0.0  # nothing recent


def test_d_measures_rates_between_two_readings():
    now = [0.0]
    meter = LoadMeter(clock=lambda: now[0])
    assert meter.rates(500) == {"prompt_tokens_per_s": 0.0, "prompts_per_s": 0.0, "output_tokens_per_s": 0.0}
    now[0], meter.prompts = 2.0, 4
    meter.sent([output(0, tokens=3)], None)
    assert meter.rates(1500) == {"prompt_tokens_per_s": 500.0, "prompts_per_s": 2.0, "output_tokens_per_s": 1.5}


def request(tokens: list[int]) -> GenerationRequest:
    return GenerationRequest("q", tokens, SamplingParams(max_new_tokens=1))


def test_the_router_says_whether_any_running_decode_replica_was_sent_the_prompts_start(monkeypatch):
    monkeypatch.setattr(routing, "_indexes", {})
    monkeypatch.setattr(routing, "_routed", {})
    prompt = list(range(3, 3 + 2 * routing.AFFINITY_BLOCK))
    assert not routing.sent_anywhere("DecodeServer", request(prompt))  # nothing routed yet
    routing._indexes["DecodeServer"] = index = routing.PrefixIndex()
    index.insert(routing.block_keys(request(prompt)), "d1")
    assert routing.sent_anywhere("DecodeServer", request(prompt + [9] * 40))  # shares the first block
    assert not routing.sent_anywhere("DecodeServer", request([9] + prompt[1:]))  # differs in it
    assert not routing.sent_anywhere("DecodeServer", request(prompt[:routing.AFFINITY_BLOCK - 1]))  # no full block
    routing._routed["DecodeServer"] = {"d2"}  # d1 is gone
    assert not routing.sent_anywhere("DecodeServer", request(prompt))
    routing._routed["DecodeServer"] = {"d1", "d2"}
    assert routing.sent_anywhere("DecodeServer", request(prompt))
    assert not routing.sent_anywhere("PrefillServer", request(prompt))  # each deployment its own index
