"""Context and generation logits (TensorRT-LLM's return_context_logits / return_generation_logits)
against transformers' logits of the same model: fp32 to 1e-4, colocated and across P and D."""

import numpy as np
import torch

from engine.request import GenerationRequest, Mode
from sampling import SamplingParams
from tests.models import load_hf
from tests.test_engine_parity import engine, prompts

NEW_TOKENS = 6


def logits_request(request_id: str, prompt: list[int], **asked) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **asked)
    return GenerationRequest(request_id, prompt, params)


def hf_logits(model_dir, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """transformers in float32: the prompt's logits [T, V], greedy generation's per-step logits
    [NEW_TOKENS, V] (output_logits: before any processor) and its tokens."""
    model = load_hf(model_dir, torch.float32)
    with torch.no_grad():
        context = model(torch.tensor([prompt])).logits[0]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return context.numpy(), torch.cat(out.logits).numpy(), out.sequences[0, len(prompt):].tolist()


def generated(outputs) -> tuple[list[int], np.ndarray]:
    return [t for o in outputs for t in o.new_token_ids], np.concatenate([o.generation_logits for o in outputs])


def test_context_and_generation_logits_equal_transformers_across_chunks(model_dirs):
    """Prompts up to 60 tokens with a 32-token step budget: the prompt's rows come from several chunks."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype="float32")
    chosen = [prompts()[i] for i in (0, 4, 7)]
    for i, prompt in enumerate(chosen):
        eng.add_request(logits_request(f"r{i}", prompt, return_context_logits=True, return_generation_logits=True))
    streams = eng.run_to_completion()
    for i, prompt in enumerate(chosen):
        context, steps, tokens = hf_logits(model_dir, prompt)
        outputs = streams[f"r{i}"]
        assert outputs[0].context_logits.shape == (len(prompt), eng.vocab_size)
        np.testing.assert_allclose(outputs[0].context_logits, context, atol=1e-4, rtol=0)
        assert all(o.context_logits is None for o in outputs[1:])  # once, with the first token
        ours, logits = generated(outputs)
        assert ours == tokens and logits.dtype == np.float32
        np.testing.assert_allclose(logits, steps, atol=1e-4, rtol=0)


def test_logits_are_raw_and_only_when_asked(model_dirs):
    """A repetition penalty changes the tokens chosen, not the logits returned (they come before any
    processor); a request that asks for nothing gets nothing, beside one that asks."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype="float32")
    prompt = prompts()[3]
    penalised = GenerationRequest("penalised", prompt, SamplingParams(
        max_new_tokens=1, temperature=0.0, repetition_penalty=5.0, return_generation_logits=True))
    plain = GenerationRequest("plain", prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
    finals = eng.generate([penalised, plain])
    context, steps, _ = hf_logits(model_dir, prompt)
    np.testing.assert_allclose(finals["penalised"].generation_logits, steps[:1], atol=1e-4, rtol=0)
    assert finals["plain"].generation_logits is None and finals["plain"].context_logits is None


def test_context_logits_bypass_the_prefix_cache_and_survive_preemption(model_dirs):
    """A prompt computed before (its blocks cached) is computed whole again; an engine so small that
    it preempts recomputes the prompt's rows into the same places."""
    model_dir = model_dirs["llama"]
    prompt = prompts()[-1]
    context, _, _ = hf_logits(model_dir, prompt)
    eng = engine(model_dir, dtype="float32", enable_prefix_caching=True)
    eng.generate([logits_request("warm", prompt)])
    final = eng.generate([logits_request("again", prompt, return_context_logits=True)])["again"]
    assert final.context_logits is None  # came with the first output
    eng.add_request(logits_request("again2", prompt, return_context_logits=True))
    first = eng.run_to_completion()["again2"][0]
    np.testing.assert_allclose(first.context_logits, context, atol=1e-4, rtol=0)

    small = engine(model_dir, dtype="float32", num_blocks=24, enable_prefix_caching=False)
    for i in range(3):
        small.add_request(logits_request(f"p{i}", prompt, return_context_logits=True))
    streams = small.run_to_completion()
    assert small.scheduler.num_preemptions > 0
    for i in range(3):
        np.testing.assert_allclose(streams[f"p{i}"][0].context_logits, context, atol=1e-4, rtol=0)


def test_prefill_then_decode_gives_the_logits_of_one_engine(model_dirs):
    """PD: P has the context logits and the first token's row; D the rest, in order."""
    model_dir = model_dirs["llama"]
    prompt = prompts()[5]
    context, steps, tokens = hf_logits(model_dir, prompt)
    prefill_engine, decode_engine = engine(model_dir, dtype="float32"), engine(model_dir, dtype="float32")
    request = logits_request("pd", prompt, return_context_logits=True, return_generation_logits=True)
    first = prefill_engine.prefill([request])["pd"]
    np.testing.assert_allclose(first.context_logits, context, atol=1e-4, rtol=0)
    decode_engine.add_request(request, Mode.DECODE, first.prefill)
    rest = [o for outs in decode_engine.run_to_completion().values() for o in outs]
    assert all(o.context_logits is None for o in rest)
    ours, logits = generated([first] + rest)
    assert ours == tokens and logits.shape == (NEW_TOKENS, decode_engine.vocab_size)
    np.testing.assert_allclose(logits, steps, atol=1e-4, rtol=0)
