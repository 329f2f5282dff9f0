"""The batch-invariant matmul (engine/execution/csrc/invariant_linear.cpp): close to torch.mm, and
each row's output the same bits whatever else shares the call (its number of rows, its offset,
the threads), which is what batch-invariant mode stands on."""

import pytest
import torch
import torch.nn.functional as F

from engine.execution import fused_ops
from engine.execution.model import linear, tiled_linear

SHAPES = [(13, 37), (576, 960), (1536, 576), (4096, 5)]  # (K, N): odd tails of K and N, the model's maps


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert fused_ops.available()  # the kernel is what is under test: no silent fallback to tiled_linear


def operands(k: int, n: int, dtype, rows: int = 2048):
    generator = torch.Generator().manual_seed(k * 7 + n)
    return (torch.randn(rows, k, generator=generator).to(dtype),
            (torch.randn(n, k, generator=generator) / k ** 0.5).to(dtype))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("k, n", SHAPES)
def test_close_to_torch_mm(dtype, tolerance, k, n):
    x, w = operands(k, n, dtype, rows=33)
    got = fused_ops.invariant_linear(x, w)
    assert got.dtype == dtype and got.shape == (33, n)
    expected = x.double() @ w.double().t()  # exact: the kernel sums in float32, rounds once to dtype
    scale = expected.abs().max()
    assert (got.double() - expected).abs().max() <= tolerance * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", SHAPES)
def test_a_row_has_the_same_bits_in_any_batch(dtype, k, n):
    x, w = operands(k, n, dtype)
    everything = fused_ops.invariant_linear(x, w)  # 2,048 rows in one call
    for start, rows in ((0, 1), (5, 1), (3, 7), (0, 32), (100, 33), (1000, 1048)):
        part = fused_ops.invariant_linear(x[start:start + rows], w)
        assert torch.equal(part, everything[start:start + rows]), (start, rows)


def test_strided_rows_and_thread_count_do_not_change_the_bits():
    x, w = operands(576, 960, torch.float32, rows=64)
    expected = fused_ops.invariant_linear(x, w)
    wide = torch.zeros(64, 2 * 576)
    wide[:, :576] = x  # rows of x as a view with stride 1152, as silu_mul's output is
    assert torch.equal(fused_ops.invariant_linear(wide[:, :576], w), expected)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = fused_ops.invariant_linear(x, w)
    finally:
        torch.set_num_threads(threads)
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
