"""The CPU kernels of engine/execution/fused_ops.py against their torch references (which
tests/test_model_ops.py holds to transformers' bits): RoPE gives the same bits in every dtype,
RMSNorm and SiLU * up are close (their sum order and exp differ), and each writes where it says."""

import pytest
import torch

from engine.execution import fused_ops
from engine.execution.fused_ops import add_rms_norm, rms_norm_reference, rope, rope_reference, silu_mul

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert fused_ops.available()  # the kernels are what is under test: no silent fallback to the references


def qkv_views(n: int, heads: int, kv_heads: int, d: int, dtype, transposed: bool, generator):
    """q [N, Hq, D], k [N, Hkv, D] as views of one projection's output, as the layer has them
    (``transposed``: stored [out, N], as model.linear returns small batches)."""
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn((width, n) if transposed else (n, width), generator=generator).to(dtype)
    qkv = qkv.t() if transposed else qkv
    q = qkv[:, : heads * d].reshape(n, heads, d) if not transposed else qkv[:, : heads * d].unflatten(1, (heads, d))
    k = qkv[:, heads * d: (heads + kv_heads) * d].unflatten(1, (kv_heads, d))
    return qkv, q, k


def tables(n: int, d: int, dtype, generator):
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=generator)[None, :] * 50
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, heads, kv_heads, d, transposed", [(1, 9, 3, 64, False), (33, 9, 3, 64, True),
                                                              (7, 32, 8, 128, False), (40, 16, 16, 128, True)])
def test_rope_kernel_is_the_reference_bit_for_bit_in_place(dtype, n, heads, kv_heads, d, transposed):
    generator = torch.Generator().manual_seed(n)
    qkv, q, k = qkv_views(n, heads, kv_heads, d, dtype, transposed, generator)
    cos, sin = tables(n, d, dtype, generator)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    expected_q, expected_k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    got_q, got_k = rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # rotated where they lie
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v, beside them, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, hidden", [(1, 576), (7, 2048), (33, 4096), (5, 1000)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_kernel_against_the_reference(dtype, n, hidden, with_delta):
    generator = torch.Generator().manual_seed(hidden + n)
    x = (torch.randn(n, hidden, generator=generator) * 3).to(dtype)
    # the delta as the layer has it: a small batch's projection, stored transposed
    delta = (torch.randn(hidden, n, generator=generator).to(dtype).t()) if with_delta else None
    weight = torch.randn(hidden, generator=generator).to(dtype)
    expected_sum = x + delta if with_delta else x.clone()
    expected = rms_norm_reference(expected_sum, weight, 1e-5)
    x_before = x.data_ptr()
    got_sum, got = add_rms_norm(x, delta, weight, 1e-5)
    assert got_sum.data_ptr() == x_before  # the residual stream is updated in place
    assert torch.equal(got_sum, expected_sum)  # the add rounds as torch's does
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # one rounding of the dtype apart at most, where the two sums of squares round apart
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-6)
        assert (got != expected).float().mean() < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, inter, transposed", [(1, 1536, False), (33, 1536, True), (7, 5461, False)])
def test_silu_mul_kernel_against_the_reference_in_place(dtype, n, inter, transposed):
    generator = torch.Generator().manual_seed(inter + n)
    shape = (2 * inter, n) if transposed else (n, 2 * inter)
    gate_up = (torch.randn(shape, generator=generator) * 4).to(dtype)
    gate_up = gate_up.t() if transposed else gate_up
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # the exp's far ends and zero
    expected = torch.nn.functional.silu(gate_up[:, :inter].float()).to(dtype) * gate_up[:, inter:]
    got = silu_mul(gate_up)
    assert got.data_ptr() == gate_up.data_ptr() and got.shape == (n, inter)  # over the gate, in place
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-6)


def test_a_dtype_without_a_kernel_takes_the_reference():
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(5, 64, generator=generator, dtype=torch.float64), torch.ones(64, dtype=torch.float64)
    before = x.clone()
    total, normed = add_rms_norm(x, x, weight, 1e-6)
    assert torch.equal(x, before) and torch.equal(total, before * 2)  # the reference adds out of place
    assert torch.equal(normed, rms_norm_reference(before * 2, weight, 1e-6))
