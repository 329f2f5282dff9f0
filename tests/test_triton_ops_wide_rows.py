"""The fused SiLU-and-multiply kernel (engine/execution/triton_ops.py) on rows wider than one of its blocks
(2,048 columns): a 1B Llama's MLP is 8,192 wide, so each row is several programs along the grid's second
axis, the last one partial. Written for the survivors of `make mutants`'s triton part (docs/testing.md):
tests/test_triton_ops.py's rows fit one block, where a kernel reading the wrong grid axis still passes."""

import torch
import torch.nn.functional as F

from engine.execution import triton_ops
from tests.test_triton_ops import TOLERANCES, randn


def test_silu_mul_of_rows_over_several_blocks_equals_the_reference():
    intermediate = 2 * 2048 + 100  # three blocks a row, the last one partial
    gate_up = randn(3, 2 * intermediate, dtype=torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), F.silu(gate).mul(up), **TOLERANCES[torch.float32])
