"""Beam search against transformers' generate(num_beams=k, num_return_sequences=k) on the same
fp32 model: the same sequences in the same order with the same scores, with and without an end
id reached, for several widths, length penalties and early_stopping values; colocated and split
over a prefill and a decode engine; blocks shared between beams and all given back."""

import numpy as np
import pytest
import torch

from engine.outputs import ABORT
from engine.request import GenerationRequest, Mode
from sampling import SamplingParams
from tests.models import load_hf
from tests.test_engine_parity import engine, prompts

PAD = 2  # not 0: transformers fills with the end id when pad_token_id is falsy

# (width, length_penalty, early_stopping, max_new_tokens, end id: None, or the greedy output's n-th token)
CASES = [(4, 1.0, False, 8, None), (2, 0.5, True, 6, None), (4, 2.0, "never", 7, None), (3, 1.0, False, 10, 1),
         (4, 0.0, True, 9, 0), (8, -0.5, "never", 6, 2)]


def end_id(hf, prompt: list[int], width: int, nth: int | None) -> int | None:
    """A token the search meets: the nth of its own best beam when no end id stops it."""
    if nth is None:
        return None
    best = hf.generate(torch.tensor([prompt]), num_beams=width, max_new_tokens=nth + 1, do_sample=False,
                       pad_token_id=PAD)
    return best[0, len(prompt) + nth].item()


def hf_beams(hf, prompt: list[int], width, penalty, early, new, eos) -> tuple[list[list[int]], list[float]]:
    out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, length_penalty=penalty,
                      early_stopping=early, max_new_tokens=new, do_sample=False, eos_token_id=eos,
                      pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
    return [s[len(prompt):].tolist() for s in out.sequences], out.sequences_scores.tolist()


def beam_params(width, penalty, early, new, eos) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, beam_width=width, length_penalty=penalty, early_stopping=early,
                          eos_token_id=eos, ignore_eos=eos is None)


def assert_same_beams(ours, theirs: list[list[int]], scores: list[float], eos: int | None):
    assert len(ours) == len(theirs)
    for hypothesis, tokens, score in zip(ours, theirs, scores):
        n = len(hypothesis.token_ids)
        assert hypothesis.token_ids == tokens[:n]  # transformers pads the shorter ones
        assert all(t == PAD for t in tokens[n:])
        assert hypothesis.score == pytest.approx(score, abs=1e-4)
        assert sum(hypothesis.logprobs) == pytest.approx(hypothesis.cum_logprob, abs=1e-4)


@pytest.mark.parametrize("width, penalty, early, new, nth", CASES)
def test_beams_equal_transformers(model_dirs, width, penalty, early, new, nth):
    model_dir = model_dirs["llama"]
    hf = load_hf(model_dir, torch.float32)
    eng = engine(model_dir, dtype="float32")
    ended_early = 0
    for i, prompt in enumerate(prompts()[2:5]):
        eos = end_id(hf, prompt, width, nth)
        theirs, scores = hf_beams(hf, prompt, width, penalty, early, new, eos)
        final = eng.generate([GenerationRequest(f"b{i}", prompt, beam_params(width, penalty, early, new, eos))])
        assert_same_beams(final[f"b{i}"].beams, theirs, scores, eos)
        assert final[f"b{i}"].output_token_ids == final[f"b{i}"].beams[0].token_ids
        ended_early += sum(h.token_ids[-1] == eos and len(h.token_ids) < new for h in final[f"b{i}"].beams)
    assert (ended_early > 0) == (nth is not None)  # with an end id, beams met it before the limit
    assert eng.blocks.counts().held == 0


def test_beams_split_over_prefill_and_decode_equal_one_engine(model_dirs):
    """P prefills once and makes the first step; one KV export; D expands the beams and goes on."""
    model_dir = model_dirs["llama"]
    prompt = prompts()[6]
    params = beam_params(4, 1.0, False, 8, None)
    colocated = engine(model_dir, dtype="float32").generate([GenerationRequest("c", prompt, params)])["c"]
    prefill_engine, decode_engine = engine(model_dir, dtype="float32"), engine(model_dir, dtype="float32")
    request = GenerationRequest("pd", prompt, params)
    first = prefill_engine.prefill([request])["pd"]
    assert first.new_token_ids == [] and not first.finished and len(first.prefill.choices) == 4
    assert first.prefill.kv.meta.num_tokens == len(prompt)  # the prompt's KV, once for all beams
    final = decode_engine.decode([(request, first.prefill)])["pd"]
    assert [h.token_ids for h in final.beams] == [h.token_ids for h in colocated.beams]
    assert [h.score for h in final.beams] == pytest.approx([h.score for h in colocated.beams], abs=1e-5)
    assert prefill_engine.blocks.counts().held == 0 and decode_engine.blocks.counts().held == 0


def test_beams_share_the_prompt_blocks(model_dirs):
    """With block_size 4, a 60-token prompt is 15 blocks: 8 beams that copied it would hold 120."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype="float32", enable_prefix_caching=False)
    prompt = prompts()[7]
    eng.add_request(GenerationRequest("s", prompt, beam_params(8, 1.0, False, 8, None)))
    most = 0
    while eng.has_work():
        eng.step()
        most = max(most, eng.blocks.counts().held)
    unshared = 8 * eng.blocks.blocks_for(len(prompt) + 8)
    assert eng.blocks.blocks_for(len(prompt)) < most <= eng.blocks.blocks_for(len(prompt)) + 8 * 3 < unshared
    assert eng.blocks.counts().held == 0


def test_an_aborted_search_ends_once_and_frees_every_beam(model_dirs):
    eng = engine(model_dirs["llama"], dtype="float32")
    eng.add_request(GenerationRequest("a", prompts()[4], beam_params(4, 1.0, False, 30, None)))
    for _ in range(6):
        assert eng.step() == []  # no output before the search ends
    assert len(eng.beam_search.groups["a"].beams) == 4
    (final,) = eng.abort("a")
    assert final.finished and final.finish_reason == ABORT and len(final.beams) == 4
    assert eng.blocks.counts().held == 0 and not eng.has_work()


def test_controls_that_reshape_the_distribution_are_refused_with_beams():
    for field, value in (("top_k", 5), ("temperature", 0.7), ("repetition_penalty", 1.2), ("seed", 3),
                         ("logprobs", 2)):
        with pytest.raises(ValueError, match=f"^{field}: does not combine with beam search"):
            SamplingParams(beam_width=2, **{field: value})
    with pytest.raises(ValueError, match="^early_stopping"):
        SamplingParams(beam_width=2, early_stopping="sometimes")


def test_a_prefill_engine_refuses_choices_beyond_the_beams(model_dirs):
    eng = engine(model_dirs["llama"], dtype="float32")
    with pytest.raises(ValueError, match="^beam_width"):
        eng.validate(GenerationRequest("n", [1, 2, 3], beam_params(2, 1.0, False, 4, None), n=2), Mode.GENERATE)


def test_generation_logits_of_each_beam_follow_its_tokens(model_dirs):
    """Each beam's rows are the raw logits at each of its positions: equal to transformers' logits
    of the beam's own tokens; colocated and across P and D alike; shorter beams padded with zeros."""
    model_dir = model_dirs["llama"]
    hf = load_hf(model_dir, torch.float32)
    prompt = prompts()[3]
    eos = end_id(hf, prompt, 4, 1)
    params = SamplingParams(max_new_tokens=6, beam_width=4, early_stopping=True, eos_token_id=eos,
                            return_generation_logits=True)
    final = engine(model_dir, dtype="float32").generate([GenerationRequest("g", prompt, params)])["g"]
    longest = max(len(h.token_ids) for h in final.beams)
    assert final.generation_logits.shape == (4, longest, hf.config.vocab_size)
    for i, hypothesis in enumerate(final.beams):
        n = len(hypothesis.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + hypothesis.token_ids])).logits[0, len(prompt) - 1:-1].numpy()
        np.testing.assert_allclose(final.generation_logits[i, :n], logits, atol=1e-4, rtol=0)
        assert not final.generation_logits[i, n:].any()
    prefill_engine, decode_engine = engine(model_dir, dtype="float32"), engine(model_dir, dtype="float32")
    request = GenerationRequest("pd", prompt, params)
    first = prefill_engine.prefill([request])["pd"]
    split = decode_engine.decode([(request, first.prefill)])["pd"]
    np.testing.assert_allclose(split.generation_logits, final.generation_logits, atol=1e-5, rtol=0)
