"""The quantized linear kernels (engine/execution/quant/csrc/quant_linear.cpp) against their reference,
the gguf package's dequantizer + a torch matmul, per type; each row's bits independent of its batch
mates and of the threads; every ISA build this CPU runs gives the native build's bits; and the
modules over them (engine/execution/quant/linear.py). The integer matrix-vector kernel
(csrc/quant_gemv.cpp) the same way, against its reference (the row quantized to int8 per 32, then
the dequantized product) and within the int8 rounding's bound of the float row's product."""

from __future__ import annotations

import gguf
from gguf import GGMLQuantizationType as Q
import numpy as np
import pytest
import torch

from engine.execution.loader import cpu_flags
from engine.execution.quant import kernels, linear as linear_module, reference
from engine.execution.quant.linear import DEQUANTIZE_ROWS, QuantizedEmbedding, QuantizedLinear

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]
GEMV_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
# (N, K) for the integer kernel: the model's maps, an odd block count (K = 544: the last pair padded), N of 1.
GEMV_SHAPES = [(960, 576), (576, 1536), (37, 544), (1, 32)]
# (N, K): the head of SmolLM2-135M's maps (qkv, down), and odd N (not a multiple of the 4-column tile).
SHAPES = [(960, 576), (576, 1536), (37, 512), (5, 256)]
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each K-quant block's float16 scales


@pytest.fixture(scope="module")
def ext():
    assert kernels.available()  # the kernels are what is under test: no silent fallback
    return kernels.build()


def blocks(quant_type: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Raw [n, row bytes] blocks of ``quant_type``: the gguf package's quantizer where it has one, else
    random bytes with small finite float16 scales (the package only dequantizes the K-quants)."""
    rng = np.random.default_rng(seed)
    if quant_type not in F16_FIELDS:
        return torch.from_numpy(gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), quant_type))
    values, nbytes = gguf.GGML_QUANT_SIZES[quant_type]
    raw = rng.integers(0, 256, (n * k // values, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[quant_type]:
        scales = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def run(ext, x: torch.Tensor, raw: torch.Tensor, quant_type: Q) -> torch.Tensor:
    out = torch.empty(x.shape[0], raw.shape[0])
    ext.quant_linear(x, raw, int(quant_type), out)
    return out


def bf16_dot(ext) -> bool:
    return ext.has_bf16_dot()


@pytest.mark.parametrize("quant_type", TYPES)
def test_dequantized_rows_are_the_gguf_packages_bits(ext, quant_type):
    raw = blocks(quant_type, 7, 512)
    assert torch.equal(ext.dequantize_rows(raw, int(quant_type), 512), reference.dequantize(raw, quant_type))


@pytest.mark.parametrize("quant_type", TYPES)
def test_dequantized_into_bfloat16_is_the_packages_weight_rounded_to_nearest_even(ext, quant_type):
    raw = blocks(quant_type, 7, 512)
    weight = torch.empty(9, 512, dtype=torch.bfloat16)
    ext.dequantize_into(raw, int(quant_type), weight[1:8])  # a contiguous block of rows of a larger buffer
    assert torch.equal(weight[1:8], reference.dequantize(raw, quant_type).bfloat16())
    with pytest.raises(RuntimeError, match=r"out \[R, K\] float32 or bfloat16"):
        ext.dequantize_into(raw, int(quant_type), torch.empty(7, 512, dtype=torch.float16))


@pytest.mark.parametrize("quant_type, n, k", [(t, n, k) for t in TYPES for n, k in SHAPES
                                               if k % gguf.GGML_QUANT_SIZES[t][0] == 0])  # whole blocks, as GGUF holds
@pytest.mark.parametrize("m", [1, 3, 6])
def test_close_to_the_dequantized_product(ext, quant_type, n, k, m):
    raw = blocks(quant_type, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n + k))
    expected = x.double() @ reference.dequantize(raw, quant_type).double().t()  # exact
    got = run(ext, x, raw, quant_type)
    assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max() * k ** 0.5


@pytest.mark.parametrize("quant_type", TYPES)
def test_bfloat16_rows_multiply_the_weight_rounded_to_bfloat16(ext, quant_type):
    if not bf16_dot(ext):
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 rows are converted to float32 by the caller")
    raw = blocks(quant_type, 37, 512)
    x = torch.randn(5, 512).bfloat16()
    weight = reference.dequantize(raw, quant_type).bfloat16()  # what the dequantized bf16 model holds
    expected = x.double() @ weight.double().t()
    got = run(ext, x, raw, quant_type)
    assert (got.double() - expected).abs().max() <= 2e-6 * expected.abs().max() * 512 ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant_type", [Q.Q4_1, Q.Q8_0, Q.Q6_K])
def test_a_row_has_the_same_bits_in_any_batch_and_thread_count(ext, dtype, quant_type):
    if dtype == torch.bfloat16 and not bf16_dot(ext):
        pytest.skip("no AVX512-BF16")
    raw = blocks(quant_type, 101, 512)
    x = torch.randn(37, 512).to(dtype)
    whole = run(ext, x, raw, quant_type)
    threads = torch.get_num_threads()
    try:
        for rows, count in [(slice(5, 6), 1), (slice(3, 10), 2), (slice(0, 37), 1)]:
            torch.set_num_threads(count)
            assert torch.equal(run(ext, x[rows], raw, quant_type), whole[rows])
    finally:
        torch.set_num_threads(threads)


def gemv(ext, x: torch.Tensor, segments: list[tuple[Q, torch.Tensor]], dtype=torch.float32) -> torch.Tensor:
    out = torch.empty(1, sum(raw.shape[0] for _, raw in segments), dtype=dtype)
    ext.quant_gemv(x, [raw for _, raw in segments], [int(t) for t, _ in segments], out)
    return out


@pytest.mark.parametrize("quant_type, n, k", [(t, n, k) for t in GEMV_TYPES for n, k in GEMV_SHAPES])
def test_integer_gemv_is_the_int8_rows_product(ext, quant_type, n, k):
    raw = blocks(quant_type, n, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n + k)) * 3
    got = gemv(ext, x, [(quant_type, raw)]).double()
    expected = reference.gemv(x, raw, quant_type)  # float64 of the int8 row's values
    assert (got - expected).abs().max() <= 2e-6 * expected.abs().max() * k ** 0.5
    # Against the float row: no more than the int8 rounding moves it, |x - x'| <= d / 2 per value.
    weight = reference.dequantize(raw, quant_type).double()
    rounding = (x.double() - reference.int8_rows(x).double()).abs()  # [1, K]
    step = x.reshape(-1, 32).abs().amax(1, keepdim=True).double() / 127
    assert (rounding.reshape(-1, 32) <= step / 2 * (1 + 1e-6)).all()
    exact = x.double() @ weight.t()
    assert ((got - exact).abs() <= rounding @ weight.abs().t() + 2e-6 * exact.abs().max() * k ** 0.5).all()


def test_integer_gemv_in_bfloat16_rounds_the_float32_result(ext):
    raw = blocks(Q.Q4_1, 101, 576)
    x = torch.randn(1, 576).bfloat16()
    assert torch.equal(gemv(ext, x, [(Q.Q4_1, raw)], torch.bfloat16),
                       gemv(ext, x, [(Q.Q4_1, raw)]).bfloat16())  # to nearest even, as torch's cast
    assert torch.equal(gemv(ext, x, [(Q.Q4_1, raw)]), gemv(ext, x.float(), [(Q.Q4_1, raw)]))


def test_integer_gemv_segments_fill_their_columns_in_any_thread_count(ext):
    segments = [(Q.Q8_0, blocks(Q.Q8_0, 67, 544, 1)), (Q.Q4_1, blocks(Q.Q4_1, 130, 544, 2)),
                (Q.Q4_0, blocks(Q.Q4_0, 9, 544, 3))]
    x = torch.randn(1, 544)
    whole = gemv(ext, x, segments)
    start = 0
    for quant_type, raw in segments:
        assert torch.equal(whole[:, start:start + raw.shape[0]], gemv(ext, x, [(quant_type, raw)]))
        start += raw.shape[0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemv(ext, x, segments), whole)
    finally:
        torch.set_num_threads(threads)


def test_integer_gemv_refuses_other_types_and_shapes(ext):
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="GGML type 14 has no integer kernel"):
        gemv(ext, x, [(Q.Q6_K, blocks(Q.Q6_K, 4, 256))])
    with pytest.raises(RuntimeError, match=r"x \[1, K\]"):
        gemv(ext, torch.randn(2, 256), [(Q.Q8_0, blocks(Q.Q8_0, 4, 256))])
    with pytest.raises(RuntimeError, match="K = 256 is not 34 bytes"):
        gemv(ext, x, [(Q.Q8_0, blocks(Q.Q8_0, 4, 32))])


@pytest.mark.parametrize("isa", ["avx2", "plain"])
def test_each_isa_build_gives_the_native_builds_bits(ext, isa):
    if isa == "avx2" and "avx2" not in cpu_flags():
        pytest.skip("this CPU does not run AVX2 code")
    other = kernels.build(isa)
    for quant_type in TYPES:
        raw = blocks(quant_type, 13, 512)
        x = torch.randn(6, 512)
        assert torch.equal(run(other, x, raw, quant_type), run(ext, x, raw, quant_type)), quant_type.name
        assert torch.equal(other.dequantize_rows(raw, int(quant_type), 512),
                           ext.dequantize_rows(raw, int(quant_type), 512))
        for build in (other, ext):
            build.dequantize_into(raw, int(quant_type), weight := torch.empty(13, 512, dtype=torch.bfloat16))
            assert torch.equal(weight, reference.dequantize(raw, quant_type).bfloat16()), quant_type.name
    for quant_type in GEMV_TYPES:  # the integer kernel: the same integers, the same float32 order
        for n, k in GEMV_SHAPES:
            raw = blocks(quant_type, n, k)
            for x in (torch.randn(1, k) * 5, torch.randn(1, k).bfloat16()):
                assert torch.equal(gemv(other, x, [(quant_type, raw)]), gemv(ext, x, [(quant_type, raw)])), \
                    (quant_type.name, n, k, x.dtype)


def test_refuses_a_type_without_kernel_and_rows_of_partial_blocks(ext):
    raw = blocks(Q.Q8_0, 4, 64)
    with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):
        run(ext, torch.randn(1, 64), raw, Q.F16)
    with pytest.raises(RuntimeError, match="K = 96 is not 68 bytes of whole blocks"):
        run(ext, torch.randn(1, 96), raw, Q.Q8_0)


def test_a_linear_of_mixed_segments_and_a_bias(ext):
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 64, 256)), (Q.Q4_1, blocks(Q.Q4_1, 32, 256, 1)),
             (Q.Q4_1, blocks(Q.Q4_1, 32, 256, 2)), (Q.Q6_K, blocks(Q.Q6_K, 32, 256, 3))]
    layer = QuantizedLinear(parts, 256, bias=True)
    assert layer.types == [Q.Q8_0, Q.Q4_1, Q.Q6_K] and layer.sizes == [64, 64, 32]  # neighbours of one type merged
    torch.nn.init.normal_(layer.bias)
    weight = torch.cat([reference.dequantize(raw, t) for t, raw in parts])  # [160, 256]
    for rows, invariant in [(3, False), (DEQUANTIZE_ROWS + 5, False), (DEQUANTIZE_ROWS + 5, True)]:
        x = torch.randn(rows, 256)
        expected = x.double() @ weight.double().t() + layer.bias.double()
        assert (layer(x, invariant).double() - expected).abs().max() <= 1e-4 * expected.abs().max()
    x = torch.randn(DEQUANTIZE_ROWS + 5, 256)
    assert torch.equal(layer(x, invariant=True)[4:5], layer(x[4:5]))  # the kernel at every size in invariant mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_outside_invariant_mode_multiply_the_dequantized_weight(ext, dtype, monkeypatch):
    """Above DEQUANTIZE_ROWS rows: W dequantized to the rows' dtype (float32 where the CPU has no
    bfloat16 dot product) and torch's GEMM; a map wider than DEQUANTIZE_BLOCK_VALUES weights in
    blocks of W's rows within each segment, with the same result as whole."""
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 64, 256)), (Q.Q4_1, blocks(Q.Q4_1, 40, 256, 1)),
             (Q.Q6_K, blocks(Q.Q6_K, 24, 256, 2))]
    layer = QuantizedLinear(parts, 256, bias=True).to(dtype)  # the bias in the model's dtype, as loaded
    torch.nn.init.normal_(layer.bias)
    weight = torch.cat([reference.dequantize(raw, t) for t, raw in parts])  # [128, 256]
    x = torch.randn(DEQUANTIZE_ROWS + 3, 256).to(dtype)
    product_dtype = dtype if ext.has_bf16_dot() else torch.float32
    rounded = weight.to(product_dtype)
    expected = torch.nn.functional.linear(x.to(product_dtype), rounded).to(dtype) + layer.bias
    whole = layer(x)
    assert whole.dtype == dtype and torch.equal(whole, expected)
    monkeypatch.setattr(linear_module, "DEQUANTIZE_BLOCK_VALUES", 48 * 256)  # blocks of <= 48 rows: 48 + 16, 40, 24
    blocked = layer(x)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (blocked.double() - whole.double()).abs().max() <= tolerance * whole.double().abs().max()
    exact = x.double() @ weight.double().t() + layer.bias.double()  # W's bfloat16 rounding within the tolerance
    assert (blocked.double() - exact).abs().max() <= 2 * tolerance * exact.abs().max()


def test_one_bfloat16_row_takes_the_integer_kernel_outside_invariant_mode(ext):
    parts = [(Q.Q8_0, blocks(Q.Q8_0, 64, 256)), (Q.Q4_1, blocks(Q.Q4_1, 32, 256, 1))]
    layer = QuantizedLinear(parts, 256)
    assert layer.integer_gemv
    x = torch.randn(4, 256).bfloat16()
    assert torch.equal(layer(x[1:2]), gemv(ext, x[1:2], parts, torch.bfloat16))
    batched = layer(x)  # four rows: the bfloat16 kernel's bits, which invariant mode keeps for one row too
    assert torch.equal(layer(x[1:2], invariant=True), batched[1:2])
    assert torch.equal(layer(x[1:2].float()), layer(x.float())[1:2])  # float32 rows never take it
    with_k_quant = QuantizedLinear(parts + [(Q.Q6_K, blocks(Q.Q6_K, 16, 256, 2))], 256)
    assert not with_k_quant.integer_gemv
    assert torch.equal(with_k_quant(x[1:2])[:, :96], batched[1:2])


def test_an_embedding_looks_up_dequantized_rows_and_is_the_tied_head(ext):
    raw = blocks(Q.Q8_0, 50, 64)
    table = reference.dequantize(raw, Q.Q8_0)
    embedding = QuantizedEmbedding(Q.Q8_0, raw, 64, torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), table[ids].bfloat16())
    x = torch.randn(2, 64)
    expected = x.double() @ table.double().t()
    assert (embedding.table(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()
