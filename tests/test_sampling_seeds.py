"""A request's seed alone decides its tokens: alone, in a crowd, after preemption, across P/D."""

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams

PROMPT = [5, 17, 33, 41, 8, 9, 100, 230]


def sampled(seed, n=16):
    return SamplingParams(max_new_tokens=n, temperature=1.0, top_k=50, top_p=0.95, seed=seed, ignore_eos=True)


def engine(**kw):
    return LLMEngine(EngineConfig(model="tiny-llama", block_size=4, **kw))


@pytest.fixture(scope="module")
def alone():
    return engine().generate([GenerationRequest("a", PROMPT, sampled(1234))])["a"].output_token_ids


def test_same_seed_same_tokens_and_other_seed_differs(alone):
    again = engine().generate([GenerationRequest("a", PROMPT, sampled(1234))])["a"].output_token_ids
    other = engine().generate([GenerationRequest("a", PROMPT, sampled(999))])["a"].output_token_ids
    assert again == alone and other != alone


def test_crowded_batch_does_not_change_a_seeded_request(alone):
    crowd = [GenerationRequest(f"c{i}", list(range(3, 3 + 7 * i + 1)), sampled(None, 20)) for i in range(12)]
    results = engine().generate(crowd[:6] + [GenerationRequest("a", PROMPT, sampled(1234))] + crowd[6:])
    assert results["a"].output_token_ids == alone


def test_preemption_does_not_change_a_seeded_request(alone):
    small = engine(num_blocks=14)
    for i in range(4):
        small.add_request(GenerationRequest(f"c{i}", list(range(3, 20)), sampled(None, 20), priority=1))
    small.add_request(GenerationRequest("a", PROMPT, sampled(1234), priority=5))  # the first victim
    was_running, preempted, result = False, False, None
    while small.has_work():
        for out in small.step():
            if out.request_id == "a" and out.finished:
                result = out
        running = any(s.request_id == "a" for s in small.scheduler.running)
        preempted |= was_running and not running and result is None
        was_running = running
    assert preempted
    assert result.output_token_ids == alone


def test_prefill_and_decode_in_two_engines_reproduce(alone):
    request = GenerationRequest("a", PROMPT, sampled(1234))
    prefill = engine().prefill([request])["a"].prefill
    assert prefill.seed == 1234
    decoded = engine().decode([(request, prefill)])["a"]
    assert decoded.output_token_ids == alone and decoded.seed == 1234


def test_server_drawn_seed_is_reported_and_reproduces():
    first = engine().generate([GenerationRequest("x", PROMPT, sampled(None))])["x"]
    assert 0 < first.seed < 2**64
    replay = engine().generate([GenerationRequest("x", PROMPT, sampled(first.seed))])["x"]
    assert replay.output_token_ids == first.output_token_ids


def test_logprobs_are_reported_and_cumulative():
    params = SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    e = engine()
    e.add_request(GenerationRequest("l", PROMPT, params))
    outs = e.run_to_completion()["l"]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert len(logprobs) == 5
    for lp in logprobs:  # greedy: the chosen token is the top alternative
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert outs[-1].cumulative_logprob == pytest.approx(sum(lp.logprob for lp in logprobs))


def test_the_sampler_alone_draws_a_seeded_row_from_its_seed_and_step_only():
    """The property above at the sampler, without a model (the test `make mutants` runs): a
    seeded row's token depends on its logits, seed and step, not on the rows beside it (greedy,
    top-p alone, min-p, other temperatures, other steps) or on its place in the batch."""
    import torch

    from sampling import Sampler
    from tests.sampling_helpers import batch_of

    vocab = 300
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(4)) * 2  # row 0 is ours
    others = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5), SamplingParams(top_k=3, min_p=0.1),
              SamplingParams(temperature=1.5), SamplingParams(top_k=500), SamplingParams(top_k=1),
              SamplingParams(min_p=0.05, top_p=0.8)]

    def draw(mine, seed, step, crowded):
        params, seeds, outputs, rows = [mine], [seed], [[1] * step], logits[:1]
        if crowded:  # ours in the middle, the others at other steps and seeds
            params = others[:3] + params + others[3:]
            seeds = [77, 78, 79, seed, 80, 81, 82, 83]
            outputs = [[1] * (step + 5 + i) for i in range(3)] + outputs + [[1] * (3 * i) for i in range(4)]
            rows = torch.cat([logits[1:4], logits[:1], logits[4:]])
        out = Sampler(torch.device("cpu"), vocab)(rows.clone(), batch_of(params, vocab, seeds=seeds, outputs=outputs))
        return out.token_ids[3 if crowded else 0]

    # top-k/top-p rows race over candidates, the others over the whole row: both paths
    for mine in (SamplingParams(temperature=0.9, top_k=40, top_p=0.9), SamplingParams(temperature=0.9)):
        alone = [draw(mine, 1234, step, False) for step in range(24)]
        assert [draw(mine, 1234, step, True) for step in range(24)] == alone
        assert len(set(alone)) > 3  # each step draws afresh, from the same logits
        assert [draw(mine, 999, step, False) for step in range(24)] != alone


def test_choice_seeds_are_the_next_seeds_wrapping_within_the_seed_range():
    """Choice i of a request seeded s draws with s + i (choice 0 is the request itself), and never
    leaves [1, MAX_SEED]: 0 is not a seed (it means "draw one"), MAX_SEED + 1 is not a uint64."""
    from sampling.params import MAX_SEED, choice_seed

    assert [choice_seed(1234, i) for i in range(4)] == [1234, 1235, 1236, 1237]
    assert [choice_seed(MAX_SEED - 1, i) for i in range(4)] == [MAX_SEED - 1, MAX_SEED, 1, 2]
    assert choice_seed(MAX_SEED, 1) == 1
    assert [choice_seed(None, i) for i in range(2)] == [None, None]  # unseeded: the engine draws each
