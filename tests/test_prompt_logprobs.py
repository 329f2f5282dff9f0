"""Prompt logprobs (a scorer's loglikelihood) against transformers' log_softmax on the same tokens."""

import pytest
import torch

from engine.request import GenerationRequest, Mode
from sampling import SamplingParams
from tests.models import load_hf
from tests.test_engine_parity import PROMPT_LENGTHS, engine, prompts

TOP = 3


def hf_prompt_scores(model_dir, prompt: list[int], dtype: torch.dtype) -> tuple[list[float], list[list[int]]]:
    """Each prompt token's logprob after the ones before it (the first has none), and the top ids there."""
    model = load_hf(model_dir, dtype)
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [T, V]
    chosen = logprobs[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    return chosen.tolist(), logprobs[:-1].topk(TOP, -1).indices.tolist()


def scoring_request(request_id: str, prompt: list[int], max_new_tokens: int = 1) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    return GenerationRequest(request_id, prompt, params)


def assert_matches(scores, prompt, reference, atol):
    chosen, top_ids = reference
    assert scores[0] is None and len(scores) == len(prompt)
    assert [s.token_id for s in scores[1:]] == prompt[1:]
    assert [s.logprob for s in scores[1:]] == pytest.approx(chosen, abs=atol)
    assert [[i for i, _ in s.top] for s in scores[1:]] == top_ids


@pytest.mark.parametrize("dtype, atol", [("float64", 1e-6), ("float32", 1e-4)])
def test_prompt_logprobs_equal_transformers_across_chunks(model_dirs, dtype, atol):
    """Prompts up to 60 tokens with a 32-token step budget: scored over several prefill chunks."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    results = eng.generate([scoring_request(f"r{i}", p) for i, p in enumerate(prompts())])
    for i, prompt in enumerate(prompts()):
        assert results[f"r{i}"].prompt_logprobs is not None
        assert_matches(results[f"r{i}"].prompt_logprobs, prompt, hf_prompt_scores(model_dir, prompt, torch_dtype),
                       atol)
    assert len(PROMPT_LENGTHS) == len(results)


def test_prompt_logprobs_come_once_and_bypass_the_prefix_cache(model_dirs):
    """The same prompt twice: the second is computed whole (a cache hit holds KV, not logits),
    and the scores come on the first output only."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype="float64", enable_prefix_caching=True)
    prompt = prompts()[-1]
    eng.generate([GenerationRequest("warm", prompt, SamplingParams(max_new_tokens=1, temperature=0.0))])
    computed = eng.scheduler.num_prompt_tokens_computed
    eng.add_request(scoring_request("again", prompt, max_new_tokens=4))
    outputs = [out for outs in eng.run_to_completion().values() for out in outs]
    assert eng.scheduler.num_prompt_tokens_computed - computed == len(prompt)
    assert [out.prompt_logprobs is not None for out in outputs] == [True, False, False, False]
    assert_matches(outputs[0].prompt_logprobs, prompt, hf_prompt_scores(model_dir, prompt, torch.float64), 1e-6)


def test_prefill_mode_reports_prompt_logprobs_and_decode_does_not_repeat_them(model_dirs):
    """PD: P scores the prompt and reports it with the first token; D's outputs carry none."""
    model_dir = model_dirs["llama"]
    prefill_engine, decode_engine = engine(model_dir), engine(model_dir)
    prompt = prompts()[3]
    request = scoring_request("pd", prompt, max_new_tokens=5)
    first = prefill_engine.prefill([request])["pd"]
    assert first.prefill is not None
    assert_matches(first.prompt_logprobs, prompt, hf_prompt_scores(model_dir, prompt, torch.float64), 1e-6)
    decode_engine.add_request(request, Mode.DECODE, first.prefill)
    outputs = [out for outs in decode_engine.run_to_completion().values() for out in outs]
    assert len(outputs) == 4 and all(out.prompt_logprobs is None for out in outputs)


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=21)
