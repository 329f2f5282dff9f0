"""Greedy parity with transformers' generate(), colocated and split across two engines."""

import copy
import functools

import pytest
import torch

from engine import llm_engine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.models import ARCHITECTURES, load_hf

PROMPT_LENGTHS = (3, 9, 17, 25, 33, 40, 51, 60)
NEW_TOKENS = 12


def prompts(seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 800, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def requests(prompt_ids: list[list[int]]) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompt_ids)]


def hf_greedy(model_dir, prompt_ids: list[list[int]]) -> list[list[int]]:
    model = load_hf(model_dir)
    outputs = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
        outputs.append(out[0, len(p):].tolist())
    return outputs


def engine(model_dir, **overrides) -> LLMEngine:
    # Small blocks and a small step budget: prompts span many blocks and are prefilled in chunks.
    settings = dict(model=str(model_dir), dtype="float64", block_size=4, max_num_batched_tokens=32)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def references(model_dirs):
    return {arch: hf_greedy(model_dirs[arch], prompts()) for arch in ARCHITECTURES}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_generate_matches_transformers(model_dirs, references, arch):
    results = engine(model_dirs[arch]).generate(requests(prompts()))
    assert [results[f"r{i}"].output_token_ids for i in range(len(PROMPT_LENGTHS))] == references[arch]
    assert all(r.finish_reason == "length" for r in results.values())


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_then_decode_in_another_engine_matches(model_dirs, references, arch):
    prefill_engine, decode_engine = engine(model_dirs[arch]), engine(model_dirs[arch])
    reqs = requests(prompts())
    prefilled = prefill_engine.prefill(reqs)
    assert prefill_engine.blocks.num_free == prefill_engine.blocks.num_blocks  # P keeps nothing
    for i, p in enumerate(PROMPT_LENGTHS):
        kv = prefilled[f"r{i}"].prefill.kv
        assert kv.data.shape[2] == p and kv.meta.num_tokens == p
        assert kv.data.flags["C_CONTIGUOUS"]
    results = decode_engine.decode([(r, prefilled[r.request_id].prefill) for r in reqs])
    assert [results[f"r{i}"].output_token_ids for i in range(len(PROMPT_LENGTHS))] == references[arch]
    assert decode_engine.blocks.num_free == decode_engine.blocks.num_blocks


def test_parity_holds_under_preemption(model_dirs, references):
    # 24 blocks of 4 tokens: far less than 8 prompts of up to 72 tokens need at once.
    small = engine(model_dirs["llama"], num_blocks=24)
    results = small.generate(requests(prompts()))
    assert small.scheduler.num_preemptions > 0
    assert [results[f"r{i}"].output_token_ids for i in range(len(PROMPT_LENGTHS))] == references["llama"]
    assert small.blocks.num_free == small.blocks.num_blocks


def hf_greedy_with_top(model_dir, prompt_ids: list[list[int]], dtype: torch.dtype, top: int = 5):
    """transformers' greedy tokens and, per step, the ids of its top ``top`` log probabilities.
    Computed once per model directory, prompts and dtype in a session (test_engine_parity,
    test_attention_backends and test_triton_attention compare with the same float32 references);
    each caller gets its own copy."""
    prompts_key = tuple(tuple(p) for p in prompt_ids)
    return copy.deepcopy(transformers_greedy_once(str(model_dir), prompts_key, dtype, top))


@functools.cache
def transformers_greedy_once(model_dir: str, prompt_ids: tuple[tuple[int, ...], ...], dtype: torch.dtype,
                             top: int) -> list[tuple[list[int], list[set[int]]]]:
    model = load_hf(model_dir, dtype)
    results = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        tops = [set(score[0].float().topk(top).indices.tolist()) for score in out.scores]
        results.append((out.sequences[0, len(p):].tolist(), tops))
    return results


def assert_close_as_vllm_does(ours: list[int], our_tops: list[set[int]], theirs: list[int],
                              their_tops: list[set[int]]) -> None:
    """vLLM's check_logprobs_close: equal tokens, or at the first difference each side's token is
    in the other's top 5; after it the sequences may go apart."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert a in their_tops[step] and b in our_tops[step], (step, ours, theirs)
            return


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_greedy_is_close_to_transformers(model_dirs, arch):
    prompt_ids = prompts()
    reference = hf_greedy_with_top(model_dirs[arch], prompt_ids, torch.bfloat16)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    bf16 = engine(model_dirs[arch], dtype="bfloat16")
    assert bf16.runner.kv_cache.dtype == torch.bfloat16
    for i, p in enumerate(prompt_ids):
        bf16.add_request(GenerationRequest(f"r{i}", p, params))
    streams = bf16.run_to_completion()
    exact = 0
    for i, (theirs, their_tops) in enumerate(reference):
        outs = streams[f"r{i}"]
        ours = outs[-1].output_token_ids
        our_tops = [{t for t, _ in lp.top} for o in outs for lp in o.logprobs]
        exact += ours == theirs
        assert_close_as_vllm_does(ours, our_tops, theirs, their_tops)
    assert exact >= len(reference) // 2  # close, and mostly equal: a real bf16 run, not noise


@pytest.mark.parametrize("model", ["llama", "llama-head128"])
def test_float32_greedy_equals_transformers(model_dirs, llama_head128_dir, model):
    """Also at Llama 3's head size (128, GQA 4), where the attention kernel has its own compiled path."""
    model_dir = llama_head128_dir if model == "llama-head128" else model_dirs[model]
    prompt_ids = prompts()
    reference = [tokens for tokens, _ in hf_greedy_with_top(model_dir, prompt_ids, torch.float32)]
    results = engine(model_dir, dtype="float32").generate(requests(prompt_ids))
    assert [results[f"r{i}"].output_token_ids for i in range(len(PROMPT_LENGTHS))] == reference


def test_dtype_auto_follows_the_cpu(monkeypatch):
    from engine.execution import loader

    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert loader.torch_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2", "amx_bf16", "amx_tile"})
    assert loader.torch_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx2", "fma"})
    assert loader.torch_dtype("auto", cpu) == torch.float32
    assert loader.torch_dtype("float64", cpu) == torch.float64


def test_a_batch_mixing_penalties_bans_and_biases_with_plain_rows_equals_transformers(model_dirs, monkeypatch):
    """fp32 greedy, one batch: rows with transformers' processors (repetition penalty, n-gram and
    bad-word bans, a logit bias as its sequence_bias, min_new_tokens) beside rows with none; each
    row's tokens equal transformers' generate() with that row's processors alone, and the decode
    steps that mix them run from the persistent batch's columns (their tokens appended and their
    stops decided by the batch's arrays at any batch size)."""
    monkeypatch.setattr(llm_engine, "ARRAY_STOPS_MIN_ROWS", 1)
    model_dir = model_dirs["llama"]
    prompt_ids = prompts()
    plain = [tokens for tokens, _ in hf_greedy_with_top(model_dir, prompt_ids, torch.float32)]
    controls = [{}, dict(repetition_penalty=1.8, min_new_tokens=NEW_TOKENS), dict(no_repeat_ngram_size=2), {},
                dict(bad_words_ids=[[plain[4][0]], [plain[4][2], plain[4][3]]]),
                dict(logit_bias={plain[5][1]: -5.0, 100: 3.0}),
                dict(repetition_penalty=0.5, no_repeat_ngram_size=3, logit_bias={plain[6][0]: -2.0}), {}]
    llm = engine(model_dir, dtype="float32")
    columns, column_steps = llm._from_columns, []
    llm._from_columns = lambda batch: column_steps.append(columns(batch)) or column_steps[-1]
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                         **c)) for i, (p, c) in enumerate(zip(prompt_ids, controls))]
    results = llm.generate(reqs)
    model = load_hf(model_dir, torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, controls)):
        hf = {k: v for k, v in c.items() if k not in ("logit_bias", "min_new_tokens")}  # transformers': always
        if "logit_bias" in c:
            hf["sequence_bias"] = {(token,): value for token, value in c["logit_bias"].items()}
        ids = torch.tensor([p])
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, pad_token_id=0, **hf)[0, len(p):].tolist()
        assert results[f"r{i}"].output_token_ids == theirs, (i, c)
    changed = sum(results[f"r{i}"].output_token_ids != plain[i] for i in (1, 2, 4, 5, 6))
    assert changed >= 3, "the controls were meant to change most of their rows' tokens"
    assert sum(column_steps) >= 3
