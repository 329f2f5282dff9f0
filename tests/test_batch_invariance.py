"""Batch-invariant mode (EngineConfig.batch_invariant; on the CPU the default, test_the_default_by_cpu_and_dtype)
in bfloat16, forced whatever this CPU picks for auto: a seeded request's tokens and logprobs do not
depend on the other requests of its steps, on P/D versus one engine, nor on how its prompt was
chunked or found in the prefix cache."""

import pytest
import torch
from transformers import LlamaConfig

from engine.config import EngineConfig
from engine.execution import fused_ops, loader
from engine.execution.attention import batch_invariant_by_default
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.models import make_random_model

# Wide enough (SmolLM-135M's width, GQA 9:3) that the GEMM library's blocking differs with the
# number of rows; two layers keep it quick.
WIDE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
NEW_TOKENS = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("wide") / "model", "llama",
                             make_config=lambda vocab: LlamaConfig(vocab_size=vocab, **WIDE))


def wide_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype="bfloat16", batch_invariant=True, block_size=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def token_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(3, 800, (n,), generator=generator).tolist() for n in lengths]


def seeded(prompts: list[list[int]], tag: str) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=50,
                                                             seed=100 + i, logprobs=2, ignore_eos=True))
            for i, p in enumerate(prompts)]


def outcome(output) -> tuple:
    """Tokens, and each token's logprob and top-2, exactly."""
    return output.output_token_ids, [(e.logprob, e.top) for e in output.logprobs]


PROMPTS = token_prompts(8, 37, 301, seed=3)
OTHERS = token_prompts(24, 5, 400, seed=4)


@pytest.mark.parametrize("flags, native", [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True),
                                           ({"amx_bf16"}, True)])
def test_the_default_by_cpu_and_dtype(wide_model, monkeypatch, flags, native):
    """On the CPU: on in float32; in bf16 where bf16 is not multiplied natively, and where it is,
    when the invariant GEMM runs on the CPU's bf16 dot product (this build has it where this CPU
    has AVX512-BF16) and the weights are in bf16, not kept quantized. fp16 on such a CPU: off. The
    environment's 1 or 0 overrides (test_the_environment_overrides_the_default)."""
    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    cpu = torch.device("cpu")
    dot_gemm = fused_ops.extension().invariant_linear_bf16_dot()
    bf16_default = not native or dot_gemm
    assert batch_invariant_by_default(cpu, torch.float32)
    assert batch_invariant_by_default(cpu, torch.float32, quantized=True)
    assert batch_invariant_by_default(cpu, torch.bfloat16) == bf16_default
    assert batch_invariant_by_default(cpu, torch.bfloat16, quantized=True) == (not native)
    assert batch_invariant_by_default(cpu, torch.float16) == (not native)
    monkeypatch.delenv("PDSERVE_BATCH_INVARIANT", raising=False)
    no_mode = dict(batch_invariant=None)  # wide_engine: bf16
    assert wide_engine(wide_model, **no_mode).runner.batch_invariant == bf16_default


def test_the_environment_overrides_the_default(wide_model, monkeypatch):
    """PDSERVE_BATCH_INVARIANT=1 or 0 decides whatever the CPU (the flags do not enter: one engine
    each, not one per CPU of test_the_default_by_cpu_and_dtype); torch_sdpa is never invariant."""
    no_mode = dict(batch_invariant=None)  # wide_engine: bf16
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "1")
    assert wide_engine(wide_model, **no_mode).runner.batch_invariant
    no_key_order = wide_engine(wide_model, attention_backend="torch_sdpa", **no_mode)
    assert not no_key_order.runner.batch_invariant
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "0")
    assert not wide_engine(wide_model, **no_mode).runner.batch_invariant


def test_a_seeded_request_is_the_same_alone_and_in_a_crowd_by_default(wide_model, monkeypatch):
    """No mode asked for, in bf16: wherever bf16 defaults to the mode (every CPU but one that
    multiplies bf16 natively without the dot-product GEMM built), alone equals in a crowd."""
    monkeypatch.delenv("PDSERVE_BATCH_INVARIANT", raising=False)
    llm = wide_engine(wide_model, batch_invariant=None)
    if not llm.runner.batch_invariant:
        pytest.skip("bf16 here defaults to the fastest mode (AMX/AVX512-BF16 without the dot-product GEMM)")
    alone = {}
    for request in seeded(PROMPTS[:3], "r"):
        alone.update({k: outcome(v) for k, v in llm.generate([request]).items()})
    crowd = llm.generate(seeded(OTHERS, "o") + seeded(PROMPTS[:3], "r"))
    assert {k: outcome(crowd[k]) for k in alone} == alone


def test_a_gguf_kept_quantized_defaults_to_the_fastest_mode_on_a_native_bf16_cpu(tmp_path, monkeypatch):
    """Its one-row decode step keeps the integer kernel (25% of a single stream, docs/sampling.md)."""
    from gguf import GGMLQuantizationType

    from tests.test_quant_model import write_tiny_gguf

    monkeypatch.delenv("PDSERVE_BATCH_INVARIANT", raising=False)
    monkeypatch.setattr(loader, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    path = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf", GGMLQuantizationType.Q4_1)
    llm = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", kv_cache_memory_gb=0.05))
    assert llm.loaded.weight_storage == "gguf:Q4_1" and not llm.runner.batch_invariant


def test_alone_together_and_in_a_crowd_are_equal(wide_model):
    llm = wide_engine(wide_model)
    alone = {}
    for request in seeded(PROMPTS, "r"):
        alone.update({k: outcome(v) for k, v in llm.generate([request]).items()})
    together = {k: outcome(v) for k, v in llm.generate(seeded(PROMPTS, "r")).items()}  # prefix hits now
    crowd = llm.generate(seeded(OTHERS, "o") + seeded(PROMPTS, "r"))
    assert together == alone
    assert {k: outcome(crowd[k]) for k in alone} == alone
    assert llm.blocks.prefix_hits > 0  # "together" and the crowd found the prompts in the prefix cache


def test_prefill_and_decode_apart_equal_one_engine(wide_model):
    colocated = wide_engine(wide_model, enable_prefix_caching=False).generate(seeded(PROMPTS, "r"))
    prefill, decode = wide_engine(wide_model), wide_engine(wide_model)
    requests = seeded(PROMPTS, "r")
    prefilled = prefill.prefill(requests[:3])  # P's batch and D's batch differ from one engine's
    prefilled.update(prefill.prefill(requests[3:]))
    decoded = decode.decode([(r, prefilled[r.request_id].prefill) for r in reversed(requests)])
    for r in requests:
        assert prefilled[r.request_id].prefill is not None  # P's first token did not end it: D went on
        assert outcome(decoded[r.request_id]) == outcome(colocated[r.request_id])


def test_context_logits_do_not_depend_on_the_chunking(wide_model):
    prompt = token_prompts(1, 400, 401, seed=5)[0]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, return_context_logits=True)

    def logits(llm: LLMEngine, rid: str) -> torch.Tensor:
        return torch.as_tensor(llm.generate([GenerationRequest(rid, prompt, params)])[rid].context_logits)

    whole = logits(wide_engine(wide_model, enable_prefix_caching=False), "whole")
    for chunk in (7, 64, 300):  # the step budget cuts the prompt into chunks of this many tokens
        assert torch.equal(logits(wide_engine(wide_model, max_num_batched_tokens=chunk), "c"), whole), chunk


def test_a_prefix_hit_continues_exactly(wide_model):
    """Context logits are computed whole (no prefix hit), so a hit is checked on what follows it:
    each generated token's raw logits."""
    prompt = token_prompts(1, 400, 401, seed=5)[0]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, return_generation_logits=True)

    def generated(llm: LLMEngine, rid: str):
        output = llm.generate([GenerationRequest(rid, prompt, params)])[rid]
        return output.output_token_ids, torch.as_tensor(output.generation_logits)

    tokens, logits = generated(wide_engine(wide_model, enable_prefix_caching=False), "fresh")
    cached = wide_engine(wide_model)
    cached.generate([GenerationRequest("warm", prompt[:250], SamplingParams(max_new_tokens=1))])
    hit_tokens, hit_logits = generated(cached, "hit")
    assert cached.blocks.prefix_hits == 240  # the 15 full blocks of the first 250 tokens
    assert hit_tokens == tokens and torch.equal(hit_logits, logits)


def test_a_gguf_kept_quantized_is_invariant_too(tmp_path):
    """GGUF weights multiplied as stored (Q4_1 on engine/execution/quant/'s kernels): in the mode,
    one row takes the multi-row kernel too (never the integer matrix-vector one), so a seeded
    request's tokens and logprobs are the same alone and in a crowd."""
    from gguf import GGMLQuantizationType

    from tests.test_quant_model import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf", GGMLQuantizationType.Q4_1)
    llm = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", batch_invariant=True, kv_cache_memory_gb=0.05))
    assert llm.loaded.weight_storage == "gguf:Q4_1"
    prompts = token_prompts(4, 5, 60, seed=6)
    alone = {}
    for request in seeded(prompts, "r"):
        alone.update({k: outcome(v) for k, v in llm.generate([request]).items()})
    crowd = llm.generate(seeded(token_prompts(12, 5, 60, seed=7), "o") + seeded(prompts, "r"))
    assert {k: outcome(crowd[k]) for k in alone} == alone
