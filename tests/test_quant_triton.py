"""The Triton kernels of GGUF's quantized types (engine/execution/quant/triton_linear.py), the CUDA
path of the quantized linear layers, against their reference: the gguf package's dequantizer + a
torch matmul, per type. Without a GPU they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) on CPU tensors, at small shapes (the interpreter runs a kernel's source in
numpy); with one, the same tests run them compiled on it.

The shapes: odd N (not a multiple of the 64-column tile), K with a last partial tile of 64 (K = 96:
three blocks of 32), M of one row, a few, and more than one 16-row tile."""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.execution.loader import quantized_kernels
from engine.execution.quant import linear as quant_linear
from engine.execution.quant import reference, triton_linear
from engine.execution.quant.linear import QuantizedEmbedding, QuantizedLinear
from engine.llm_engine import LLMEngine
from tests.test_quant_linear import blocks
from tests.test_quant_model import greedy, write_tiny_gguf

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
# (N, K) per type: K whole blocks of the type; N odd; for the 32-blocks a K ending in a partial tile.
SHAPES = {Q.Q8_0: [(37, 96), (70, 256)], Q.Q4_0: [(37, 96), (70, 256)], Q.Q4_1: [(37, 96), (70, 256)],
          Q.Q4_K: [(37, 256), (70, 512)], Q.Q6_K: [(37, 256), (70, 512)]}


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(DEVICE)


def bound(x: torch.Tensor, weight: torch.Tensor, relative: float) -> torch.Tensor:
    """Per output, ``relative`` x sum_k |x_k w_k|: a rounding's bound on each sum, [M, N] float64."""
    return relative * (x.double().abs() @ weight.double().abs().t()) + 1e-30


@pytest.mark.parametrize("quant_type", TYPES)
def test_dequantized_rows_are_the_gguf_packages_bits(quant_type):
    n, k = SHAPES[quant_type][0]
    raw = blocks(quant_type, n, k)
    got = triton_linear.dequantize_rows(on_device(raw), quant_type, k).cpu()
    assert torch.equal(got, reference.dequantize(raw, quant_type))


@pytest.mark.parametrize("quant_type, n, k", [(t, n, k) for t in TYPES for n, k in SHAPES[t]])
@pytest.mark.parametrize("m", [1, 5, 19])
def test_float32_rows_are_the_dequantized_product(quant_type, n, k, m):
    raw = blocks(quant_type, n, k, seed=m)
    weight = reference.dequantize(raw, quant_type)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n + k + m))
    expected = x.double() @ weight.double().t()  # exact
    got = triton_linear.linear(on_device(x), on_device(raw), quant_type).cpu()
    assert got.shape == (m, n) and got.dtype == torch.float32
    # IEEE float32 products and sums (no TF32): within float32's rounding of the sum of |products|
    assert ((got.double() - expected).abs() <= bound(x, weight, k * 2 ** -24)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant_type", TYPES)
def test_16_bit_rows_multiply_the_weight_rounded_to_their_dtype(quant_type, dtype):
    """The weight decoded, rounded to the rows' dtype, multiplied exactly and summed in float32.
    (The interpreter rounds float32 to bfloat16 toward zero: within one unit in the last place of
    the round-to-nearest weight, which the bound allows on either side.)"""
    n, k = SHAPES[quant_type][1]
    raw = blocks(quant_type, n, k, seed=1)
    weight = reference.dequantize(raw, quant_type)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    expected = x.double() @ weight.to(dtype).double().t()
    got = triton_linear.linear(on_device(x), on_device(raw), quant_type).cpu()
    unit = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # the dtype's unit in the last place
    assert ((got.double() - expected).abs() <= bound(x, weight, unit + k * 2 ** -24)).all()
    # and the bound is tight enough to catch a wrong block: the float32 weight's product differs by less
    assert ((got.double() - x.double() @ weight.double().t()).abs() <= bound(x, weight, 2 * unit)).all()


def test_segments_write_their_columns_of_one_output():
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 40, 256)), (Q.Q6_K, blocks(Q.Q6_K, 24, 256, 1))]
    x = torch.randn(3, 256)
    out = on_device(torch.full((3, 64), float("nan")))  # [3, 64]: every column written by one segment
    triton_linear.linear(on_device(x), on_device(parts[0][1]), Q.Q8_0, out.narrow(1, 0, 40))
    triton_linear.linear(on_device(x), on_device(parts[1][1]), Q.Q6_K, out.narrow(1, 40, 24))
    weight = torch.cat([reference.dequantize(raw, t) for t, raw in parts])
    expected = x.double() @ weight.double().t()
    assert ((out.cpu().double() - expected).abs() <= bound(x, weight, 256 * 2 ** -24)).all()


def test_refuses_a_type_without_kernel_and_rows_of_another_k():
    raw = blocks(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="no Triton kernel for GGUF type Q5_0"):
        triton_linear.linear(torch.randn(1, 64), raw, Q.Q5_0)
    with pytest.raises(ValueError, match=r"is not rows of 96 Q8_0 weights"):
        triton_linear.linear(torch.randn(1, 96), raw, Q.Q8_0)


@pytest.fixture
def triton_path(monkeypatch):
    """The modules take their CUDA path (the Triton kernels) on this device, CPU included."""
    monkeypatch.setattr(quant_linear, "uses_triton", lambda raw: True)


def test_the_modules_take_the_triton_kernels_with_bias_and_embedding(triton_path):
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 64, 256)), (Q.Q4_1, blocks(Q.Q4_1, 32, 256, 1)), (Q.Q4_K, blocks(Q.Q4_K, 9, 256))]
    layer = QuantizedLinear(parts, 256, bias=True).to(DEVICE)
    torch.nn.init.normal_(layer.bias)
    weight = torch.cat([reference.dequantize(raw, t) for t, raw in parts])  # [105, 256]
    x = torch.randn(3, 256)
    expected = x.double() @ weight.double().t() + layer.bias.detach().cpu().double()
    got = layer(on_device(x)).cpu()
    assert ((got.double() - expected).abs() <= bound(x, weight, 256 * 2 ** -24) + 1e-6).all()
    assert torch.equal(layer.dequantized().cpu(), weight)
    raw = blocks(Q.Q6_K, 50, 256)
    embedding = QuantizedEmbedding(Q.Q6_K, raw, 256, torch.bfloat16).to(DEVICE)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(on_device(ids)).cpu(), reference.dequantize(raw, Q.Q6_K)[ids].bfloat16())


def test_the_loader_picks_the_kernels_by_device(tmp_path, caplog):
    assert quantized_kernels(torch.device("cuda")) == "Triton"  # triton is installed here (the test dependency)
    assert quantized_kernels(torch.device("cpu")) == "C++"
    assert quantized_kernels(torch.device("meta")) is None
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    with caplog.at_level("INFO", logger="engine.execution.loader"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_gb=0.05))
    assert "multiplied by the C++ kernels on cpu" in caplog.text


@pytest.mark.slow
def test_a_tiny_gguf_on_the_triton_kernels_keeps_the_dequantized_models_greedy_tokens(tmp_path, triton_path,
                                                                                     monkeypatch):
    """A tiny Llama written with the gguf writer in Q8_0 (tests/test_quant_model.py), its linear weights
    and token table on the Triton kernels, against the same file dequantized: float32, the same
    weight values, only the order of the sums differs. Under the interpreter with 256-wide tiles (its
    time goes per tile: a step takes seconds instead of ten); the kernel tests above keep the GPU's."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(triton_linear, "BLOCK_N", 256)
        monkeypatch.setattr(triton_linear, "BLOCK_K", 256)
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", Q.Q8_0)
    stored = LLMEngine(EngineConfig(model=str(path), dtype="float32", device=DEVICE.type, kv_cache_memory_gb=0.05,
                                    max_num_batched_tokens=32))  # its warm-up step: 32 rows
    assert stored.loaded.weight_storage == "gguf:Q8_0"
    dequantized = LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="dequantize",
                                         kv_cache_memory_gb=0.05))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 891, int(length)).tolist() for length in (5, 17)]
    got, expected = greedy(stored, prompts, 8), greedy(dequantized, prompts, 8)
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.95 * 2 * 8, f"{same} of {2 * 8} positions equal"
