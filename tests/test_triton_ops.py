"""The fused CUDA elementwise kernels (engine/execution/triton_ops.py) against the model's torch reference.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
every run checks their indexing and rounding; with one, the same tests run them compiled on it.
The kernels round where the reference rounds: in float32 they agree to a float32 sum's order, in
bfloat16 on a GPU to the last bit of the odd element where rsqrt or exp differ. (Triton's
interpreter rounds float32 to bfloat16 toward zero, not to nearest: there bfloat16 results are
within a few units in the last place, and the bit count is checked on a GPU only.)
"""

import pytest
import torch
import torch.nn.functional as F

from engine.execution import triton_ops
from engine.execution.fused_ops import rope_reference as _rope
from engine.execution.model import RMSNorm

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
# bfloat16: 2 ** -7 relative is one unit in the last place; the interpreter's truncation takes up to 3.
ULPS = 1 if DEVICE.type == "cuda" else 3
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5),
              torch.bfloat16: dict(atol=ULPS * 2 ** -7, rtol=ULPS * 2 ** -7)}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 2048])
@pytest.mark.parametrize("with_add", [False, True])
def test_rms_norm_equals_the_reference(dtype, hidden, with_add):
    x, add = randn(7, hidden, dtype=dtype), randn(7, hidden, dtype=dtype, seed=1)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, dtype=dtype, seed=2))
        residual = x + add if with_add else x
        expected = norm(residual)
        got, got_residual = triton_ops.rms_norm(x, norm.weight, 1e-5, add if with_add else None)
    if dtype == torch.float32 or DEVICE.type == "cuda":
        assert torch.equal(got_residual, residual)  # the sum rounds as torch's add does
    torch.testing.assert_close(got_residual, residual, **TOLERANCES[dtype])
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    if dtype == torch.bfloat16 and DEVICE.type == "cuda":  # the same roundings: the odd element differs
        assert (got != expected).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [100, 1536])
def test_silu_mul_equals_the_reference(dtype, intermediate):
    gate_up = randn(5, 2 * intermediate, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).mul(up)
    got = triton_ops.silu_mul(gate_up)
    assert torch.equal(gate_up, randn(5, 2 * intermediate, dtype=dtype))  # the input is left as it was
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 64), ((8, 1), 128), ((3, 3), 80)])
def test_rope_in_place_on_views_of_qkv_equals_the_reference(dtype, heads, head_dim):
    num_heads, num_kv_heads = heads
    rows, width = 6, (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(rows, width, dtype=dtype)
    q = qkv[:, :num_heads * head_dim].view(rows, num_heads, head_dim)  # views, as the model has them
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(rows, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    positions = torch.tensor([0, 5, 63, 7, 7, 30], device=DEVICE)
    cos, sin = cos[positions], sin[positions]  # [N, D]: each token's row, as the model passes them
    expected_q, expected_k = _rope(q, cos, sin), _rope(k, cos, sin)
    triton_ops.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, **TOLERANCES[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched

