"""The triton_paged attention kernel (engine/execution/attention/triton_paged.py) on a tile whose rows' scores
differ by orders of magnitude: each row's softmax is taken against its own running maximum, so a token
with huge scores beside ordinary ones in the same tile leaves theirs finite and equal to the reference's
(a maximum over the whole tile underflows their exponentials to 0 and divides 0 by 0). Written for the
survivors of `make mutants`'s triton part (docs/testing.md); tests/test_triton_attention.py has the rest."""

import torch

from benchmarks.attention import scattered_step
from engine.execution.attention import torch_sdpa, triton_paged
from tests.test_triton_attention import POOL_BLOCKS, attend, inputs


def test_rows_of_very_different_scales_in_one_tile_each_take_their_own_softmax():
    block_size, heads = 16, (4, 4)
    seqs, slots = scattered_step([(0, 8)], POOL_BLOCKS, block_size)  # one prompt of 8 tokens: one tile
    q, k, v, caches = inputs(len(slots), heads, 64, torch.float32, block_size)
    q[-1] *= 1000.0  # the last token's scores ~1,000 times the others'
    expected, _, _ = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, None, block_size)
    got, _, _ = attend(triton_paged.TritonPagedBackend(group=1), seqs, slots, q, k, v, caches, None, block_size)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
