"""Exponential noise keyed by (seed, step, index), for the exponential-race sample.

The draw at index j for generation step t of a request with seed s is a pure function of
(s, t, j): a counter-based hash computed with torch integer ops. The index is the candidate's
position in the row the race runs over, as the operator reads its q (seeds/003:
``probs / (q + eps)`` over the sorted, truncated candidates): the j-th largest kept token when
top-k or top-p sorted the row, token j when neither did. So a request's samples do not depend
on the other rows of the batch, on preemption and recomputation, on the backend, or on whether
prefill and decode ran in different processes; and the noise for a whole batch is one
vectorised computation, no Python loop and no per-request ``torch.Generator``.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32).

    Products of two 32-bit values may wrap int64; the low 32 bits kept by the mask are
    exact under two's-complement wrap-around, so the result is the true uint32 hash.
    """
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    """A uint64 seed as (low, high) 32-bit halves, since torch has no uint64 arithmetic."""
    return seed & _MASK32, (seed >> 32) & _MASK32


def exponential_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor,
                      token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws q for each (row, index).

    seed_lo, seed_hi, step: [R] int64; token_ids: [R, C] or [C] int64 indices (candidate
    positions, or token ids where the race runs over the whole row). Returns float32 [R, C] in (0, 17.4]: a 24-bit uniform u in (0, 1), q = -log(u).
    """
    row_key = _mix32(_mix32(seed_hi ^ _GOLDEN) ^ seed_lo)  # [R]
    row_key = _mix32(row_key ^ (step & _MASK32))  # [R]
    h = _mix32(row_key[:, None] ^ ((token_ids * _GOLDEN) & _MASK32))  # [R, C]
    uniform = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)
