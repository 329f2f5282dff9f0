"""The embedded tiny-llama and model loading."""

import hashlib
import socket

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.kv_transfer import KVMeta, KVMismatchError, check_compatible, numpy_to_tensor, tensor_to_numpy
from engine.execution.loader import resolve_model_dir
from engine.llm_engine import LLMEngine
from engine.cli import main as cli_main


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_model_is_deterministic_and_complete(tmp_path):
    assert cli_main(["make-tiny-model", str(tmp_path / "a")]) == 0
    assert cli_main(["make-tiny-model", str(tmp_path / "b")]) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tokenizer.eos_token == "</s>" and tokenizer.bos_token == "<s>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.startswith("<s>") and "hi" in chat and chat.endswith("<|assistant|>\n")


def test_hub_id_that_is_not_local_fails_at_once(monkeypatch):
    """No download attempt, no network retries: with the hub's offline switch off (the suite sets
    HF_HUB_OFFLINE), any name lookup or connection the call tries is recorded and refused."""
    from huggingface_hub import constants

    tried = []

    def no_network(*args, **kwargs):
        tried.append(args)
        raise OSError("the test allows no network")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(ValueError, match="local directory"):
        resolve_model_dir("some-org/not-downloaded-model")
    assert tried == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engines_run(dtype):
    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype=dtype))
    from engine.request import GenerationRequest
    from sampling import SamplingParams

    out = engine.generate([GenerationRequest("r", [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0))])["r"]
    assert out.num_output_tokens == 4
    # Seeded, EOS ignored: a first token that happened to be EOS would end the request on P.
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=11)
    prefill = engine.prefill([GenerationRequest("p", [5, 6, 7], params)])["p"].prefill
    expected = np.int16 if dtype == "bfloat16" else np.float16
    assert prefill.kv.data.dtype == expected and prefill.kv.meta.dtype == dtype


def test_bf16_travels_as_int16_bits_and_back():
    kv = torch.randn(2, 2, 5, 3, 4).to(torch.bfloat16)
    array = tensor_to_numpy(kv)
    assert array.dtype == np.int16 and array.shape == (2, 2, 5, 3, 4)
    assert torch.equal(numpy_to_tensor(array, torch.bfloat16), kv)


def test_kv_metadata_mismatch_names_the_field():
    mine = KVMeta("abc", "float32", 4, 4, 32, 10)
    check_compatible(mine, mine, 10)
    with pytest.raises(KVMismatchError, match="kv.model_id"):
        check_compatible(KVMeta("other", "float32", 4, 4, 32, 10), mine, 10)
    with pytest.raises(KVMismatchError, match="kv.dtype"):
        check_compatible(KVMeta("abc", "bfloat16", 4, 4, 32, 10), mine, 10)
    with pytest.raises(KVMismatchError, match="kv.num_tokens"):
        check_compatible(mine, mine, 11)


def test_decode_refuses_kv_of_another_model(model_dirs):
    from engine.request import GenerationRequest, Mode
    from sampling import SamplingParams

    p_engine = LLMEngine(EngineConfig(model=str(model_dirs["llama"])))
    d_engine = LLMEngine(EngineConfig(model=str(model_dirs["qwen2"])))
    request = GenerationRequest("x", [5, 6, 7], SamplingParams(max_new_tokens=3))
    prefill = p_engine.prefill([request])["x"].prefill
    with pytest.raises(KVMismatchError, match="kv.model_id"):
        d_engine.add_request(request, Mode.DECODE, prefill)


def test_the_kv_pool_is_resident_only_where_written():
    """A CPU engine's KV pool is zero and takes memory only as its pages are written: an engine of a
    1 GB pool holds a few MB of it after a request (every replica of an app, and every engine of
    the suite, used to write its whole pool at start: 0.5 GB by default)."""
    import psutil

    process = psutil.Process()
    before = process.memory_info().rss
    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", kv_cache_memory_gb=1.0))
    pool = engine.runner.kv_cache
    pool_bytes = pool.numel() * pool.element_size()
    assert pool_bytes >= 0.99 * (1 << 30)
    from engine.execution.model_runner import kv_pool_resident_bytes
    from engine.request import GenerationRequest
    from sampling import SamplingParams

    out = engine.generate([GenerationRequest("r", list(range(5, 40)), SamplingParams(max_new_tokens=8, temperature=0))])
    assert out["r"].num_output_tokens == 8
    assert process.memory_info().rss - before < pool_bytes / 3  # the model, warm-up and first imports included (~180 MB)
    # the pool is a mapping of its own, by name: what a request touched is resident, not the rest
    # (< 5%: 8 touched regions of 4 layers x K, V stay < 51 MB even in 2 MB pages where shmem uses them)
    assert 0 < kv_pool_resident_bytes(process) < pool_bytes / 20
    assert pool[:, :, -1024:].count_nonzero() == 0  # slots nobody wrote read 0
