"""Prefix-aware PD in the engines: D says how much of a prompt it holds and keeps it, P sends only
the rest, D stitches the two; over a multi-turn conversation the output is a cold engine's.
The router's prefix index (the policy's choices: tests/test_pd_policy.py). tests/test_serve_pd_prefix.py runs it
under Ray Serve."""

import time
from types import SimpleNamespace

import pytest

from deployments.pd.routing import AFFINITY_BLOCK, IMBALANCE_REQUESTS, PrefixIndex, block_keys, load, rank
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, Mode
from tests.test_prefix_cache import SYSTEM, assert_all_blocks_back, greedy, make_engine, sampled


def pd_turn(p: LLMEngine, d: LLMEngine, request: GenerationRequest) -> tuple[list[int], int, int]:
    """One request through P and D with decode-side reuse: (output, tokens D held, tokens P sent)."""
    held = d.hold_prefix(request, None, time.time() + 60)
    p.add_request(request, Mode.PREFILL, kv_export_start=held)
    handoff = p.run_to_completion()[request.request_id][0].prefill
    sent = handoff.kv.meta.num_tokens - handoff.kv.meta.start
    out = d.decode([(request, handoff)])[request.request_id]
    return out.output_token_ids, held, sent


def conversation(run, params_for, count: int = 4) -> tuple[list[list[int]], list[int], list[int]]:
    """Turns of a conversation through ``run`` (a request -> (output, held, sent)): each prompt
    is the one before, its answer, and 5 new tokens."""
    history, outputs, held, sent = list(SYSTEM), [], [], []
    for k in range(count):
        history += [100 + 7 * k + j for j in range(5)]
        out, h, s = run(GenerationRequest(f"t{k}", list(history), params_for(k)))
        outputs.append(out)
        held.append(h)
        sent.append(s)
        history += out
    return outputs, held, sent


@pytest.mark.parametrize("params_for", [lambda k: greedy(9), lambda k: sampled(9, seed=40 + k)],
                         ids=["greedy", "seeded"])
def test_a_conversation_sends_only_what_decode_lacks_and_gets_a_cold_engines_tokens(params_for):
    p, d = make_engine(), make_engine()
    reused, held, sent = conversation(lambda r: pd_turn(p, d, r), params_for)
    cold, _, _ = conversation(lambda r: (make_engine().generate([r])[r.request_id].output_token_ids, 0, 0),
                              params_for)
    assert reused == cold
    # Each later turn finds on D every full block of the turn before: its prompt and all but the
    # last of its answer's tokens (the last one's KV is made by the next step, which never ran).
    prompt_lengths = [40 + 5 + 14 * k for k in range(4)]
    assert held[0] == 0 and sent[0] == prompt_lengths[0]
    for k in range(1, 4):
        before = prompt_lengths[k - 1] + 9 - 1
        assert held[k] == before // 4 * 4
        assert sent[k] == prompt_lengths[k] - held[k]
    assert sum(sent) * 3 <= sum(prompt_lengths)
    assert len(d.holds) == 0
    assert_all_blocks_back(p)
    assert_all_blocks_back(d)


def test_a_held_prefix_survives_eviction_until_its_request_ends():
    """Between D's answer and the request's arrival, another request takes every block it can:
    the held ones are not among them, so D can still stitch P's partial KV."""
    p, d = make_engine(), make_engine(num_blocks=16)
    first = GenerationRequest("a", SYSTEM + [50, 51], greedy(4))
    d.decode([(first, p.prefill([first])["a"].prefill)])
    assert d.block_counts().cached == 11  # 45 computed tokens: the prompt's 10 blocks and one more
    follow = GenerationRequest("b", SYSTEM + [60, 61, 62], greedy(6))
    held = d.hold_prefix(follow, None, time.time() + 60)
    assert held == 40 and d.block_counts().held == 10
    d.generate([GenerationRequest("flood", [700 + i for i in range(16)], greedy(8))])  # 6 blocks: all the rest
    assert d.block_counts().cached == 5  # the flood's 5 full blocks; it evicted the 11th, not the held 10
    p.add_request(follow, Mode.PREFILL, kv_export_start=held)
    handoff = p.run_to_completion()["b"][0].prefill
    got = d.decode([(follow, handoff)])["b"]
    assert got.error is None and got.output_token_ids == make_engine().generate([follow])["b"].output_token_ids
    assert len(d.holds) == 0
    assert_all_blocks_back(d)


def test_a_hold_whose_request_never_comes_ends_at_its_time_and_with_an_abort():
    d = make_engine()
    first = GenerationRequest("a", SYSTEM + [50, 51], greedy(4))
    d.generate([first])
    assert d.hold_prefix(GenerationRequest("late", SYSTEM + [70], greedy(4)), None, time.time() - 1) == 40
    assert d.hold_prefix(GenerationRequest("gone", SYSTEM + [71], greedy(4)), None, time.time() + 60) == 40
    assert d.block_counts().held == 10  # the two holds share the system prompt's blocks
    d.step()  # the first hold's time has passed
    assert len(d.holds) == 1
    d.abort("gone")  # the ingress chose otherwise, or its client left
    assert len(d.holds) == 0
    assert_all_blocks_back(d)


def test_decode_prefilling_locally_keeps_the_pd_token_cap():
    """D counts its tokens after the first (P's) against max_iter_times; prefilling a request
    itself, it still does, so local and remote give the same number of tokens."""
    request = GenerationRequest("cap", SYSTEM[:9], greedy(50))
    plain = make_engine(max_iter_times=5).generate([request])["cap"].output_token_ids
    d = make_engine(max_iter_times=5, first_token_from_prefill=True)
    local = d.generate([request])["cap"].output_token_ids
    first = make_engine(max_iter_times=5).prefill([request])["cap"]
    remote_tokens = d.decode([(request, first.prefill)])["cap"].output_token_ids  # P's first token, then D's
    assert len(plain) == 5 and len(local) == 6 and local == remote_tokens


def test_the_router_index_matches_leading_blocks_per_replica():
    index = PrefixIndex(capacity=8)
    base = GenerationRequest("a", list(range(3 * AFFINITY_BLOCK + 5)), greedy(1))
    longer = GenerationRequest("b", base.prompt_token_ids + list(range(500, 500 + AFFINITY_BLOCK)), greedy(1))
    index.insert(block_keys(base), "r1")
    index.insert(block_keys(longer), "r2")
    assert index.matched_tokens(block_keys(longer), ["r1", "r2", "r3"]) == {
        "r1": 3 * AFFINITY_BLOCK, "r2": 4 * AFFINITY_BLOCK, "r3": 0}
    other = GenerationRequest("c", [9] + base.prompt_token_ids[1:], greedy(1))  # differs in the first block
    assert index.matched_tokens(block_keys(other), ["r1", "r2"]) == {"r1": 0, "r2": 0}
    index.insert([bytes([i]) for i in range(8)], "r3")  # past its capacity the oldest entries go
    assert index.matched_tokens(block_keys(longer), ["r1", "r2"]) == {"r1": 0, "r2": 0}


def fake_replica(name: str, **stats):
    return SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: name), routing_stats=stats)


def test_the_router_prefers_the_replica_with_the_prefix_unless_loads_are_far_apart():
    prompt = list(range(3, 3 + 4 * AFFINITY_BLOCK))
    turn = GenerationRequest("t", prompt, greedy(1))
    a, b = fake_replica("test-a", requests=3), fake_replica("test-b", requests=0)
    first = rank("test-affinity", turn, [a, b], prefill=False)[0]
    assert first is b  # no prefix anywhere yet: the less loaded
    longer = GenerationRequest("t2", prompt + [9] * AFFINITY_BLOCK, greedy(1))
    busy = fake_replica("test-b", requests=IMBALANCE_REQUESTS - 1)  # b, now busier, still within the bound
    assert rank("test-affinity", longer, [a, busy], prefill=False)[0] is busy  # b was sent the prefix
    overloaded = fake_replica("test-b", requests=IMBALANCE_REQUESTS + 5)
    assert rank("test-affinity", longer, [a, overloaded], prefill=False)[0] is a  # too far apart: load first
    # P weighs queued prompt tokens, and counts what it was just sent.
    p1, p2 = fake_replica("test-p1", queued_prompt_tokens=0), fake_replica("test-p2", queued_prompt_tokens=100)
    assert rank("test-prefill", turn, [p1, p2], prefill=True)[0] is p1
    assert load(p1, prefill=True, now=time.monotonic()) == len(prompt)  # just sent, not reported yet
