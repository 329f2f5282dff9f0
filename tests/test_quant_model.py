"""A GGUF served with its weights kept quantized, in process: a tiny Llama written locally with the
gguf writer from tiny-llama's weights (q and k permuted as llama.cpp's converter does; every linear
quantized but down_proj, whose K = 688 is not whole blocks and stays float32, as llama.cpp's
converter falls back) loads with the stored types on the kernels, and its greedy tokens match the
same file served dequantized (float32, the same weight values: only the order of the sums differs);
one bfloat16 stream, on the integer kernel, close to it as vLLM's quantization tests compare.
``quantization: int8`` on tiny-llama itself: the same against its weights' int8 values, and refused for a GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as Q
import numpy as np
import pytest
from safetensors.numpy import load_file
import torch

from engine.cli import main as cli_main
from engine.config import EngineConfig
from engine.execution.quant import kernels
from engine.execution.quant.int8 import int8_blocks
from engine.execution.quant.linear import QuantizedEmbedding, QuantizedLinear
from engine.execution.quant.reference import dequantize
from engine.execution.tiny_model import ensure_tiny_model
from engine.llm_engine import LLMEngine
from engine.offline import run_to_completion
from engine.request import GenerationRequest
from sampling import SamplingParams

NAMES = {"embed_tokens": "token_embd", "lm_head": "output", "norm": "output_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    parts = hf_name.removeprefix("model.").removesuffix(".weight")
    if parts.startswith("layers."):
        _, index, module = parts.split(".", 2)
        return f"blk.{index}.{NAMES[module]}.weight"
    return f"{NAMES[parts]}.weight"


def permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (convert_hf_to_gguf.py LlamaModel.permute)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, quant_type: Q) -> Path:
    source = ensure_tiny_model()
    config = json.loads((source / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    vocab = gguf.vocab.BpeVocab(source)
    tokens, scores, types = zip(*vocab.all_tokens())
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    gguf.SpecialVocab(source, load_merges=True).add_to_gguf(writer)
    for name, tensor in load_file(source / "model.safetensors").items():
        tensor = tensor.astype(np.float32)
        if ".q_proj." in name:
            tensor = permuted(tensor, config["num_attention_heads"])
        elif ".k_proj." in name:
            tensor = permuted(tensor, config["num_key_value_heads"])
        if tensor.ndim == 2 and tensor.shape[1] % gguf.GGML_QUANT_SIZES[quant_type][0] == 0:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(tensor, quant_type), raw_dtype=quant_type)
        else:  # norms, and down_proj (K = 688)
            writer.add_tensor(gguf_name(name), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [results[f"r{i}"].output_token_ids for i in range(len(prompts))]


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> np.ndarray:
    """The prompt's raw logits [prompt tokens, V], float32."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, return_context_logits=True)
    engine.add_request(GenerationRequest("logits", prompt, params))
    outputs = [out for out in run_to_completion(engine)["logits"] if out.context_logits is not None]
    return outputs[0].context_logits


@pytest.mark.parametrize("quant_type", [Q.Q8_0, Q.Q4_1])
def test_greedy_tokens_match_the_dequantized_model(tmp_path, quant_type, caplog):
    path = write_tiny_gguf(tmp_path / f"tiny.{quant_type.name}.gguf", quant_type)
    with caplog.at_level("WARNING"):
        stored = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_gb=0.05))
    assert "F32 (4) have no quantized kernel" in caplog.text  # the four down_proj, named in the log
    model = stored.loaded.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.layers[0].qkv_proj, QuantizedLinear) and not isinstance(model.layers[0].down_proj,
                                                                                    QuantizedLinear)
    assert stored.loaded.weight_storage == f"gguf:{quant_type.name}"
    assert stored.loaded.weight_bytes <= 1.2 * path.stat().st_size
    dequantized = LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="dequantize",
                                         kv_cache_memory_gb=0.05))
    assert dequantized.loaded.weight_storage == "float32"
    assert stored.loaded.model_id != dequantized.loaded.model_id  # P and D never mix their KV
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 891, int(length)).tolist() for length in rng.integers(4, 40, 8)]
    got, expected = greedy(stored, prompts, 64), greedy(dequantized, prompts, 64)
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.95 * 8 * 64, f"{same} of {8 * 64} positions equal"
    # The prompt's logits: the same weight values summed in float32 in another order, so within
    # float32 rounding of each other (stated tolerance: 1e-4 of the largest logit).
    ours, theirs = prompt_logits(stored, prompts[0]), prompt_logits(dequantized, prompts[0])
    assert ours.shape == (len(prompts[0]), 891)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.parametrize("quant_type", [Q.Q8_0])
def test_one_bfloat16_stream_takes_the_integer_kernel_and_stays_close(tmp_path, quant_type, monkeypatch):
    """One stream at a time in bfloat16: every decode step is one row, which takes the integer kernel
    (int8 activations, counted); its greedy tokens against the file dequantized in float32, compared
    as vLLM compares a quantized model's (check_logprobs_close): equal up to the first difference,
    and there each side's token among the other's top 5. Q8_0 only: tiny-llama's logits are nearly
    flat (top 5 within 0.2 nats), and Q4_1's own weight error already moves its ties past a top 5
    (Q4_1 on the integer kernel: tests/test_quant_linear.py's bound against the float row)."""
    path = write_tiny_gguf(tmp_path / f"tiny.{quant_type.name}.gguf", quant_type)
    stored = LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", batch_invariant=False,
                                    kv_cache_memory_gb=0.05))
    reference = LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="dequantize",
                                       kv_cache_memory_gb=0.05))
    ext = kernels.build()
    calls = []
    monkeypatch.setattr(ext, "quant_gemv", lambda *args, gemv=ext.quant_gemv: calls.append(1) or gemv(*args))
    rng = np.random.default_rng(2)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, length in enumerate(rng.integers(4, 40, 6)):
        prompt = rng.integers(3, 891, int(length)).tolist()
        ours, theirs = (engine.generate([GenerationRequest(f"s{i}", prompt, params)])[f"s{i}"]
                        for engine in (stored, reference))
        for mine, other in zip(ours.logprobs, theirs.logprobs):
            if mine.token_id != other.token_id:
                assert mine.token_id in [token for token, _ in other.top], (i, ours.output_token_ids)
                assert other.token_id in [token for token, _ in mine.top], (i, theirs.output_token_ids)
                break
    assert len(calls) >= 6 * 31  # each request's 31 decode steps, each at least once


def test_int8_quantizes_a_hugging_face_checkpoint_and_keeps_its_greedy_tokens():
    """Against the same checkpoint with each int8 weight's dequantized values in float32 (the
    quantization's own error is the gguf package's Q8_0, |w - w'| <= half a block's step)."""
    model = str(ensure_tiny_model())
    int8 = LLMEngine(EngineConfig(model=model, dtype="float32", quantization="int8", kv_cache_memory_gb=0.05))
    loaded = int8.loaded
    assert loaded.weight_storage == "int8:Q8_0"
    assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(loaded.model.lm_head, QuantizedLinear)
    assert not isinstance(loaded.model.layers[0].down_proj, QuantizedLinear)  # K = 688: kept in float32
    reference = LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory_gb=0.05))
    assert loaded.weight_bytes < 0.45 * reference.loaded.weight_bytes
    with torch.no_grad():
        for name, module in reference.loaded.model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.shape[1] % 32 == 0:
                values = dequantize(int8_blocks(module.weight), Q.Q8_0)
                step = module.weight.reshape(-1, 32).abs().amax(1, keepdim=True) / 127
                # half a step, and the float16 rounding of the scale (127 x 2^-11 steps at most)
                assert ((values - module.weight).reshape(-1, 32).abs() <= 0.57 * step + 1e-7).all(), name
                module.weight.copy_(values)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 891, int(length)).tolist() for length in rng.integers(4, 40, 8)]
    got, expected = greedy(int8, prompts, 64), greedy(reference, prompts, 64)
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.95 * 8 * 64, f"{same} of {8 * 64} positions equal"


def test_int8_is_refused_for_a_gguf(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    with pytest.raises(ValueError, match="quantization: int8 is for Hugging Face checkpoints"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="int8"))


def test_float64_serves_a_gguf_dequantized(tmp_path, caplog):
    """float64 is the exact-parity dtype; the kernels sum in float32, so the file is dequantized (logged)."""
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    with caplog.at_level("WARNING"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float64", kv_cache_memory_gb=0.05))
    assert engine.loaded.weight_storage == "float64"
    assert "serving its weights dequantized" in caplog.text


def test_pdserve_generate_takes_the_quantization_setting(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    args = ["generate", "hello", "--model", str(path), "--dtype", "float32", "--max-new-tokens", "2"]
    assert cli_main(args + ["--quantization", "dequantize"]) == 0
    assert cli_main(args + ["--quantization", "int8"]) == 2
    assert "quantization: int8 is for Hugging Face checkpoints" in capsys.readouterr().err
