"""Greedy parity with transformers' generate(), colocated and split across two engines."""

import pytest
import torch

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
