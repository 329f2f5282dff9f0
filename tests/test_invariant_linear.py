"""The batch-invariant matmul (engine/execution/csrc/invariant_linear.cpp): close to torch.mm, and
each row's output the same bits whatever else shares the call (its number of rows, its offset,
the threads), which is what batch-invariant mode stands on. Both of its paths for bfloat16: the
native build's (vdpbf16ps where this CPU has AVX512-BF16) and the float32 lanes of a CPU without
AVX-512 (the "avx2" build, run here too)."""

import pytest
import torch
import torch.nn.functional as F

from engine.execution import fused_ops
from engine.execution.loader import cpu_flags
from engine.execution.model import linear, tiled_linear

# (K, N): odd tails of K (13 < 32; 613 = 19 x 32 + 5) and N, the model's maps
SHAPES = [(13, 37), (613, 37), (576, 960), (1536, 576), (4096, 5)]
ISAS = ["native", "avx2"] if "avx2" in cpu_flags() else ["native"]


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert fused_ops.available()  # the kernel is what is under test: no silent fallback to tiled_linear


@pytest.fixture(scope="module", params=ISAS)
def ext(request):
    return fused_ops.extension(request.param)


def operands(k: int, n: int, dtype, rows: int = 2048):
    generator = torch.Generator().manual_seed(k * 7 + n)
    return (torch.randn(rows, k, generator=generator).to(dtype),
            (torch.randn(n, k, generator=generator) / k ** 0.5).to(dtype))


def test_bfloat16_takes_the_dot_product_instructions_where_the_cpu_has_them():
    """The native build multiplies bfloat16 by vdpbf16ps exactly where the CPU has AVX512-BF16
    (-march=native); a build without AVX-512 keeps the float32 lanes."""
    assert fused_ops.extension().invariant_linear_bf16_dot() == bool({"avx512_bf16", "avx512bw"} <= cpu_flags())
    if "avx2" in ISAS:
        assert not fused_ops.extension("avx2").invariant_linear_bf16_dot()


@pytest.mark.parametrize("k, n", SHAPES)
def test_bfloat16_is_close_to_aten_mm(ext, k, n):
    """As vLLM's kernel tests compare bfloat16: torch.testing's bfloat16 tolerances against torch's own
    bfloat16 matmul (rtol 1.6e-2), atol 1e-2 of the outputs' scale."""
    x, w = operands(k, n, torch.bfloat16, rows=33)
    got = ext.invariant_linear(x, w)
    expected = torch.mm(x, w.t())
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("k, n", SHAPES)
def test_close_to_torch_mm(ext, dtype, tolerance, k, n):
    x, w = operands(k, n, dtype, rows=33)
    got = ext.invariant_linear(x, w)
    assert got.dtype == dtype and got.shape == (33, n)
    expected = x.double() @ w.double().t()  # exact: the kernel sums in float32, rounds once to dtype
    scale = expected.abs().max()
    assert (got.double() - expected).abs().max() <= tolerance * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", SHAPES)
def test_a_row_has_the_same_bits_in_any_batch(ext, dtype, k, n):
    x, w = operands(k, n, dtype)
    everything = ext.invariant_linear(x, w)  # 2,048 rows in one call
    for start, rows in ((0, 1), (5, 1), (3, 7), (0, 32), (100, 33), (1000, 1048)):
        part = ext.invariant_linear(x[start:start + rows], w)
        assert torch.equal(part, everything[start:start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_thread_count_do_not_change_the_bits(ext, dtype):
    x, w = operands(576, 960, dtype, rows=64)
    wide = torch.zeros(64, 2 * 576, dtype=dtype)
    wide[:, :576] = x  # rows of x as a view with stride 1152, as silu_mul's output is
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # two whatever this process's own count: one thread would compare 1 with 1
        expected = ext.invariant_linear(x, w)
        strided = ext.invariant_linear(wide[:, :576], w)
        torch.set_num_threads(1)
        one_thread = ext.invariant_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(strided, expected)
    assert torch.equal(one_thread, expected)


def test_linear_in_invariant_mode_takes_the_kernel_or_its_torch_stand_in():
    x, w = operands(576, 960, torch.float32, rows=9)
    bias = torch.randn(960)
    assert torch.equal(linear(x, w, bias, invariant=True), fused_ops.invariant_linear(x, w) + bias)
    fused_ops.set_kernels_enabled(False)
    try:
        assert torch.equal(linear(x, w, bias, invariant=True), tiled_linear(x, w, bias))
    finally:
        fused_ops.set_kernels_enabled(True)
    assert torch.allclose(linear(x, w, bias, invariant=True), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_refuses_mismatched_operands():
    x, w = operands(13, 37, torch.float32, rows=4)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        fused_ops.extension().invariant_linear(x, w[:, :12].contiguous())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        fused_ops.extension().invariant_linear(x.double(), w.double())
