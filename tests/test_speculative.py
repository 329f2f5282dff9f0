"""Speculative decoding (engine/decoding/speculative.py, sampling/speculative.py): draft tokens the request
sends, and prompt lookup. Drafts given as tokens leave the output token for token what it is
without them, greedy and seeded; drafts with the draft model's logits leave the distribution
unchanged (chi-square). Accounting holds when several tokens arrive in one step."""

import numpy as np
import pytest
from scipy.stats import chisquare
import torch

from engine.outputs import EOS, LENGTH, STOP
from engine.request import DraftTokens, GenerationRequest
from engine.decoding.speculative import accepted_length, prompt_lookup
from sampling import Sampler, SamplingParams
from tests.sampling_helpers import batch_of
from tests.test_sampling_distribution import exact_distribution
from tests.test_engine_parity import engine

PROMPT = [1, 5, 9, 30, 31, 32, 33, 5, 9, 30, 31, 7, 5, 9]
NEW = 24
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, seed=11, repetition_penalty=1.3,
                        ignore_eos=True)


@pytest.fixture(scope="module")
def spec_engine(model_dirs):
    return engine(model_dirs["llama"], dtype="float32", num_blocks=256)


def run(eng, params, **fields) -> tuple[list[int], list]:
    """One request to the end: its output ids, and every output it streamed."""
    eng.add_request(GenerationRequest("r", PROMPT, params, **fields))
    outputs = eng.run_to_completion()["r"]
    return outputs[-1].output_token_ids, outputs


def counts(eng) -> tuple[int, int, int]:
    d = eng.drafter
    return d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens


def test_prompt_lookup_finds_the_latest_match_of_the_longest_suffix():
    tokens = np.array([4, 5, 6, 9, 4, 5, 7, 8, 1, 4, 5])
    assert prompt_lookup(tokens, 3, 1, 3) == [7, 8, 1]  # "4 5": its latest earlier occurrence is at 4
    assert prompt_lookup(tokens, 3, 3, 3) == []  # "1 4 5" occurs nowhere before
    assert prompt_lookup(np.array([3, 3]), 4, 1, 2) == [3, 3, 3, 3]  # a loop goes on looping
    assert prompt_lookup(np.array([9, 1, 2, 1, 2]), 5, 2, 2) == [1, 2, 1, 2, 1]
    assert accepted_length([5, 6, 7], [5, 6, 8]) == 2 and accepted_length([1], [2]) == 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_right_wrong_and_partly_right_give_the_output_without_drafts(spec_engine, params):
    plain, _ = run(spec_engine, params)
    right = plain[:8]
    partly = plain[:4] + [(t + 1) % 500 for t in plain[4:8]]
    wrong = [(t + 3) % 500 for t in plain[:8]]
    for drafts, stood in ((right, 7), (partly, 3), (wrong, 0)):
        before = counts(spec_engine)
        ours, _ = run(spec_engine, params, draft=DraftTokens(drafts))
        after = counts(spec_engine)
        assert ours == plain
        # The first draft is checked against the prompt's token; the other 7 in one step when drafts[0] stands.
        assert after[2] - before[2] == stood
        assert after[1] - before[1] == (7 if drafts[0] == plain[0] else 0)
        assert spec_engine.block_counts().held == 0


def test_prompt_lookup_gives_the_same_tokens_and_proposes_drafts(model_dirs):
    # Single-token matches: a random model's output repeats few pairs, and wrong drafts are the point here.
    eng = engine(model_dirs["llama"], dtype="float32", num_blocks=256, prompt_lookup_min=1)
    # No repetition penalty here: it keeps a random model from repeating any token lookup could match.
    # Seed 16: an output that repeats pairs of its context (seed 11 did under the race's former noise order).
    for params in (GREEDY, SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=20, seed=16, ignore_eos=True)):
        plain, _ = run(eng, params)
        before = counts(eng)
        ours, _ = run(eng, params, prompt_lookup=True)
        assert ours == plain
        assert counts(eng)[1] > before[1]
    assert eng.block_counts().held == 0


def test_prompt_lookup_accepts_on_a_model_that_repeats_itself(model_dirs):
    """tiny-llama's greedy output loops, as a model copying from its context does: lookup's drafts stand."""
    eng = engine("tiny-llama", dtype="float32", num_blocks=256)
    plain, _ = run(eng, GREEDY)
    ours, outputs = run(eng, GREEDY, prompt_lookup=True)
    drafts, drafted, accepted = counts(eng)
    assert ours == plain and accepted > 0
    steps_with_tokens = len({o.num_output_tokens for o in outputs})
    assert len(outputs) == NEW == steps_with_tokens  # each token its own output, one after another


def test_several_tokens_in_one_step_are_separate_outputs_and_the_limits_hold(spec_engine):
    plain, _ = run(spec_engine, GREEDY)
    perfect = DraftTokens(plain[:8])
    # max_new_tokens inside an accepted run
    ours, outputs = run(spec_engine, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True),
                        draft=perfect)
    assert ours == plain[:5] and outputs[-1].finish_reason == LENGTH
    assert [o.new_token_ids for o in outputs] == [[t] for t in plain[:5]]
    assert [o.num_output_tokens for o in outputs] == [1, 2, 3, 4, 5]
    # a stop sequence and an end id inside an accepted run
    stop = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, stop_token_ids=[plain[2:4]])
    ours, outputs = run(spec_engine, stop, draft=perfect)
    assert ours == plain[:4] and outputs[-1].finish_reason == STOP
    end = SamplingParams(max_new_tokens=NEW, temperature=0.0, eos_token_id=plain[5])
    ours, outputs = run(spec_engine, end, draft=perfect)
    assert ours == plain[:plain.index(plain[5]) + 1] and outputs[-1].finish_reason == EOS
    assert spec_engine.block_counts().held == 0


def test_mixed_batch_and_the_prefix_cache_after_accepted_drafts(model_dirs):
    """Drafted, looked-up and plain requests share steps; the blocks their accepted drafts filled are
    keyed by the tokens in them: a later prompt that extends the output hits them and continues as
    an engine without a cache does. Single-token matches: a random model repeats no pair of tokens."""
    eng = engine(model_dirs["llama"], dtype="float32", num_blocks=256, prompt_lookup_min=1)
    prompts = [PROMPT, PROMPT[3:] + [44, 45], [8, 9, 10, 8, 9, 10, 8]]
    plain = eng.generate([GenerationRequest(f"p{i}", p, GREEDY) for i, p in enumerate(prompts)])
    mixed = [GenerationRequest("p0", prompts[0], GREEDY, draft=DraftTokens(plain["p0"].output_token_ids[:8])),
             GenerationRequest("p1", prompts[1], GREEDY, prompt_lookup=True),
             GenerationRequest("p2", prompts[2], GREEDY)]
    eng.blocks.reset_prefix_cache()
    before = counts(eng)
    ours = eng.generate(mixed)
    assert {r: o.output_token_ids for r, o in ours.items()} == {r: o.output_token_ids for r, o in plain.items()}
    # p0's 8 right drafts verify 7 tokens (the first meets the prompt's token); lookup drafted p1's on top.
    assert counts(eng)[1] - before[1] > 7
    longer = PROMPT + plain["p0"].output_token_ids[:20]
    before = eng.blocks.prefix_hits
    cached = eng.generate([GenerationRequest("x", longer, GREEDY)])["x"].output_token_ids
    assert eng.blocks.prefix_hits - before == 32  # 8 full blocks of 4, keyed by the drafted request's steps
    cold = engine(model_dirs["llama"], dtype="float32", num_blocks=256, enable_prefix_caching=False)
    assert cached == cold.generate([GenerationRequest("x", longer, GREEDY)])["x"].output_token_ids
    assert eng.block_counts().held == 0


def test_drafts_on_decode_after_prefill_elsewhere(model_dirs, spec_engine):
    plain, _ = run(spec_engine, SEEDED)
    p = engine(model_dirs["llama"], dtype="float32", num_blocks=256)
    d = engine(model_dirs["llama"], dtype="float32", num_blocks=256)
    request = GenerationRequest("r", PROMPT, SEEDED, draft=DraftTokens(plain[:8]))
    first = p.prefill([request])["r"]
    out = d.decode([(GenerationRequest("r", PROMPT, SEEDED, draft=DraftTokens(plain[:8])), first.prefill)])["r"]
    assert first.new_token_ids + out.output_token_ids[1:] == plain
    assert d.drafter.num_accepted_tokens == 7
    assert p.block_counts().held == d.block_counts().held == 0


def test_draft_logits_greedy_is_unchanged_and_seeded_is_reproducible(spec_engine):
    vocab = spec_engine.vocab_size
    plain, _ = run(spec_engine, GREEDY)
    logits = np.random.default_rng(0).normal(size=(8, vocab)).astype(np.float32)
    ours, _ = run(spec_engine, GREEDY, draft=DraftTokens(plain[:8], logits))
    assert ours == plain
    seeded = [run(spec_engine, SEEDED, draft=DraftTokens(plain[:8], logits))[0] for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == NEW


def test_drafts_the_engine_refuses_name_the_field(spec_engine):
    vocab = spec_engine.vocab_size
    cases = [(DraftTokens([5] * 9), GREEDY, "draft_input_ids"),
             (DraftTokens([vocab]), GREEDY, "draft_input_ids"),
             (DraftTokens([5, 6], np.zeros((2, vocab + 1), np.float32)), GREEDY, "draft_logits"),
             (DraftTokens([5], np.full((1, vocab), np.inf, np.float32)), GREEDY, "draft_logits"),
             (DraftTokens([5]), SamplingParams(beam_width=2), "draft_input_ids")]
    for draft, params, field in cases:
        with pytest.raises(ValueError, match=f"^{field}:"):
            spec_engine.validate(GenerationRequest("bad", PROMPT, params, draft=draft))
    with pytest.raises(ValueError, match="^draft_logits:"):
        GenerationRequest("bad", PROMPT, GREEDY, draft=DraftTokens([5, 6], np.zeros((1, vocab), np.float32)))
    with pytest.raises(ValueError, match="^prompt_lookup:"):
        spec_engine.validate(GenerationRequest("bad", PROMPT, SamplingParams(beam_width=2), prompt_lookup=True))
    assert spec_engine.validate(GenerationRequest("ok", PROMPT, GREEDY, draft=DraftTokens([5] * 8))) is None


VOCAB = 48
DRAWS = 20_000


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (12, 0.9, 0.7)])
def test_the_speculative_sampling_rule_leaves_the_distribution_unchanged(top_k, top_p, temperature):
    """Rows that verify a draft drawn from q, with q sent: the tokens that come out follow p, the
    sampler's own distribution; the drafts stand about as often as sum(min(p, q)) says."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(VOCAB, generator=generator) * 2.0
    q = torch.softmax(torch.randn(VOCAB, generator=generator) * 2.0, -1)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=generator).tolist()
    params = SamplingParams(top_k=top_k, top_p=top_p, temperature=temperature)
    batch = batch_of([params] * DRAWS, VOCAB, seeds=list(range(1, DRAWS + 1)))
    for row, draft in zip(batch.rows, drafts):
        row.draft_token, row.draft_probs = draft, q
    batch = type(batch).build(batch.rows, VOCAB, torch.device("cpu"))
    tokens = np.array(Sampler(torch.device("cpu"), VOCAB)(logits.expand(DRAWS, VOCAB).clone(), batch).token_ids)
    p = exact_distribution(logits / temperature, top_k, top_p)
    observed = np.bincount(tokens, minlength=VOCAB)
    assert observed[p == 0].sum() == 0
    support = p > 0
    statistic, p_value = chisquare(observed[support], p[support] / p[support].sum() * DRAWS)
    assert p_value > 1e-3, (statistic, p_value)
    stood = np.mean(tokens == np.array(drafts))
    assert abs(stood - np.minimum(p, q.double().numpy()).sum()) < 0.02
    again = Sampler(torch.device("cpu"), VOCAB)(logits.expand(DRAWS, VOCAB).clone(), batch).token_ids
    assert (np.array(again) == tokens).all()  # keyed by seed and step: the same draws again
