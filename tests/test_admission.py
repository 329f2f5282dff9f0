"""Admission control (deployments/ingress/admission.py), in-process: budgets counted in tokens and requests
per role and per replica, priority's headroom at the bound, and charges released exactly once.
The burst through every dialect against a running app is in tests/test_stalls.py; the release of a
request's charges on every path of its flow in tests/test_request_flow.py."""

from pathlib import Path

import pytest
import yaml

from deployments.ingress.admission import IN_FLIGHT_FACTOR, SHARE, Admission, Overloaded, serve_max_ongoing
from deployments.config import AppArgs
from engine.request import GenerationRequest
from sampling import SamplingParams

TOKENS_PER_REPLICA = 1000
ROOT = Path(__file__).resolve().parents[1]


def request(prompt_tokens: int, max_tokens: int, priority: int = 5, n: int = 1) -> GenerationRequest:
    return GenerationRequest(f"r{prompt_tokens}-{max_tokens}-{priority}", list(range(1, prompt_tokens + 1)),
                             SamplingParams(max_new_tokens=max_tokens), priority=priority, n=n)


def pd(replicas: dict[str, int] | None = None, requests_per_replica: int = 256) -> Admission:
    counts = replicas or {"PrefillServer": 1, "DecodeServer": 1}
    return Admission("PrefillServer", "DecodeServer", TOKENS_PER_REPLICA, requests_per_replica, counts.__getitem__)


def fill(admission: Admission, priority: int, cost: int) -> list:
    """Admit requests of ``cost`` tokens at ``priority`` until one is refused; the tickets."""
    tickets = []
    for _ in range(1000):
        try:
            tickets.append(admission.admit(request(cost // 2, cost - cost // 2, priority)))
        except Overloaded:
            return tickets
    pytest.fail("nothing was refused")


def test_the_bound_is_in_tokens_prompt_plus_every_choices_max_tokens():
    admission = pd()
    first = admission.admit(request(100, 100))  # 200 tokens of D's 600 (priority 5: 60%)
    with pytest.raises(Overloaded) as refused:
        admission.admit(request(10, 200, n=2))  # 410 more: two requests, but too many tokens
    assert refused.value.retry_after == 1 and "DecodeServer" in str(refused.value)
    admission.admit(request(10, 190, n=2))  # 390 more: fits exactly
    assert admission.load["DecodeServer"].tokens == 590 and admission.load["PrefillServer"].tokens == 110
    first.done()
    assert admission.load["DecodeServer"].tokens == 390


def test_the_bound_is_also_in_requests():
    admission = pd(requests_per_replica=10)
    tickets = fill(admission, 5, 2)  # tiny requests: the count binds, not the tokens
    assert len(tickets) == 6 == int(SHARE[5] * 10)


def test_priority_1_is_admitted_at_the_bound_where_priority_5_is_refused():
    admission = pd()
    fill(admission, 5, 100)  # priority 5 filled its 60%
    with pytest.raises(Overloaded):
        admission.admit(request(50, 50, priority=5))
    admission.admit(request(50, 50, priority=1))  # the headroom kept for higher priorities
    assert len(fill(admission, 1, 100)) == 9  # priority 1's own 1000 tokens, beside priority 5's 600
    with pytest.raises(Overloaded):
        admission.admit(request(50, 50, priority=1))


def test_the_budget_grows_with_the_replicas():
    replicas = {"PrefillServer": 1, "DecodeServer": 1}
    admission = pd(replicas)
    one = len(fill(admission, 1, 100))
    replicas["DecodeServer"] = replicas["PrefillServer"] = 3
    assert one == 10 and len(fill(admission, 1, 100)) == 20


def test_an_idle_role_admits_a_request_larger_than_its_budget():
    admission = pd()
    admission.admit(request(2000, 2000, priority=3))
    with pytest.raises(Overloaded):
        admission.admit(request(1, 1, priority=3))
    admission.admit(request(2000, 2000, priority=1))  # nothing of priority 1 in flight: idle for it


def test_lower_priority_work_never_refuses_a_higher_priority_request():
    """Priority is an order of service: priority p is measured against the work of priority <= p
    only, so priority 5 filling its share, in tokens or in requests, never refuses priority 1..4,
    and priority 1 is refused only by priority-1 work filling the whole budget."""
    admission = pd(requests_per_replica=10)
    fill(admission, 5, 100)  # 6 requests, 600 tokens: priority 5's 60% (of both bounds)
    assert admission.load["DecodeServer"].requests_by_priority[5] == 6
    assert len(fill(admission, 4, 100)) == 7  # priority 4's 70%, none of it taken by priority 5
    assert len(fill(admission, 1, 100)) == 10  # priority 1: the whole budget, beside 13 lower ones
    with pytest.raises(Overloaded, match="priority 1..1"):
        admission.admit(request(1, 1, priority=1))
    assert admission.load["DecodeServer"].requests == 23 <= IN_FLIGHT_FACTOR * 10


def test_the_engines_serve_cap_is_admissions_most_in_flight():
    """Serve's router must never queue a call admission let through (a queued call waits in FIFO
    order, not by priority): the configs' engine deployments take what admission can send them."""
    assert serve_max_ongoing(256) == 1024 == IN_FLIGHT_FACTOR * 256
    for name in ("local.yaml", "colocated.yaml", "pd-autoscale.yaml"):
        app = yaml.safe_load((ROOT / "configs" / name).read_text())["applications"][0]
        budget = app["args"].get("max_ongoing_requests", AppArgs.model_fields["max_ongoing_requests"].default)
        engines = [d for d in app["deployments"] if d["name"] in ("PrefillServer", "DecodeServer", "LLMServer")]
        assert engines and all(d["max_ongoing_requests"] == serve_max_ongoing(budget) for d in engines), name


def test_colocated_has_one_role():
    admission = Admission(None, "LLMServer", TOKENS_PER_REPLICA, 256, lambda _: 1)
    ticket = admission.admit(request(30, 70))
    assert list(admission.load) == ["LLMServer"] and admission.load["LLMServer"].tokens == 100
    ticket.prefilled()  # nothing of P's to release
    assert admission.load["LLMServer"].tokens == 100
    ticket.done()
    assert admission.load["LLMServer"].tokens == 0
