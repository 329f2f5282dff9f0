"""The fused RMSNorm kernel (engine/execution/triton_ops.py) on rows whose mean square is of the order of
eps, where eps decides the result (a layer's near-silent activations): the reference's
x / sqrt(mean(x^2) + eps), not a sum that drops or flips eps. Written for the survivors of
`make mutants`'s triton part (docs/testing.md); tests/test_triton_ops.py has the kernels' other cases."""

import torch

from engine.execution import triton_ops
from engine.execution.model import RMSNorm
from tests.test_triton_ops import DEVICE, TOLERANCES, randn


def test_rms_norm_of_rows_as_small_as_eps_equals_the_reference():
    hidden, eps = 576, 1e-5
    x = randn(3, hidden, dtype=torch.float32) * torch.tensor([[1e-4], [1e-3], [1e-2]], device=DEVICE)
    norm = RMSNorm(hidden, eps).to(DEVICE, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, dtype=torch.float32, seed=2))
        expected = norm(x)
        got, _ = triton_ops.rms_norm(x, norm.weight, eps)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    assert got[0].abs().max() < 0.2 * expected[2].abs().max()  # the smallest row is mostly eps: damped
