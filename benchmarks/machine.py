"""The machine's own limits, measured in the same run as a benchmark: matmul rate and copy bandwidth."""

from __future__ import annotations

import time

import torch


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """Peak-ish FLOP/s of one large square matmul."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    seconds = _best_of(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s moved (read + write) by one large tensor copy."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    seconds = _best_of(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() / seconds
