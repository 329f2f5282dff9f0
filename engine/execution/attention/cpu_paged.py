"""The CPU backend: a C++ kernel that reads the KV pool in place (csrc/paged_attention.cpp).

One call per layer per step covers the step's rows: each row reads its sequence's blocks through
the block table, with no gathered copy, no padding and no repeated K/V for GQA, and a softmax in
float32. Its reduction over keys runs in one fixed order (block by block, aligned to absolute
positions), so a row's output does not depend on the other rows of the step or on how its prompt
was chunked: the ground the batch-invariant mode stands on (docs/sampling.md).

Which rows: in batch-invariant mode, all of them. Otherwise the decodes only, and prefill chunks
go to torch's flash SDPA (the reference's chunk path), which runs a long query block several
times faster than this kernel's per-row loops (benchmarks/RESULTS.md, "Attention backends").

The extension is compiled for this machine's CPU (-march=native) by ``make install``
(``python -m engine.execution.attention.cpu_paged``), one build per source text and flags
(engine/execution/extensions.py); later loads only import it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from engine.execution.attention import AttentionSeq, fill_block_tables
from engine.execution.attention.torch_sdpa import BACKEND as SDPA, SdpaStep
from engine.execution.extensions import build_extension

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
MAX_BLOCK_SIZE = 64  # the kernel's kMaxBlock


@cache
def extension():
    """The compiled kernel, built on first use (a minute on 2 cores) and kept (engine/execution/extensions.py)."""
    return build_extension("pdserve_paged_attention", [SOURCE], CFLAGS)


@cache
def available() -> bool:
    """Whether the kernel builds and loads here; if not, engines asked for no mode run the fastest (no invariance)."""
    try:
        extension()
    except Exception as error:  # a missing compiler, an unsupported platform
        log.warning("attention: the cpu_paged kernel is unavailable (%s)", error)
        return False
    return True


@dataclass
class PagedStep:
    slot_mapping: torch.Tensor  # [N] slot each new token's K/V is written to
    tables: torch.Tensor  # [T, MB] int32: row i is sequence i's block table, 0-padded
    seq_rows: torch.Tensor  # [T] int64: each sequence's first row in the flat batch
    seq_positions: torch.Tensor  # [T] int64: the position of that row
    seq_lengths: torch.Tensor  # [T] int64: its rows in the step
    block_size: int
    chunks: SdpaStep | None  # the prefill chunks left to SDPA (outside batch-invariant mode)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, window: int | None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D]; k_cache/v_cache [S, Hkv, D]. Returns [N, Hq, D]."""
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if len(self.seq_rows):
            extension().paged_attention(out, q, k_cache, v_cache, self.tables, self.seq_rows, self.seq_positions,
                                        self.seq_lengths, self.block_size, window or 0, q.shape[-1] ** -0.5)
        if self.chunks is not None:
            self.chunks.attend_chunks(q, k, v, k_cache, v_cache, window, out)
        return out


class PagedBackend:
    name = "cpu_paged"

    def __init__(self, all_rows: bool) -> None:
        """``all_rows``: the kernel takes prefill chunks too (batch-invariant mode)."""
        self.all_rows = all_rows

    def prepare(self, slot_mapping: torch.Tensor, seqs: list[AttentionSeq], windows: set[int | None],
                block_size: int, device: torch.device) -> PagedStep:
        if block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size: the cpu_paged attention takes at most {MAX_BLOCK_SIZE}")
        chunks = None
        if not self.all_rows and any(s.num_tokens > 1 for s in seqs):
            chunks = SDPA.prepare(slot_mapping, [s for s in seqs if s.num_tokens > 1], windows, block_size, device)
            seqs = [s for s in seqs if s.num_tokens == 1]
        max_blocks = max((len(s.block_table) for s in seqs), default=1)
        tables = torch.from_numpy(fill_block_tables(np.empty((len(seqs), max_blocks), dtype=np.int32),
                                                    [s.block_table for s in seqs]))
        columns = torch.from_numpy(np.array([(s.flat_start, s.start_pos, s.num_tokens) for s in seqs],
                                            dtype=np.int64).reshape(len(seqs), 3))
        return PagedStep(slot_mapping, tables, columns[:, 0].contiguous(), columns[:, 1].contiguous(),
                         columns[:, 2].contiguous(), block_size, chunks)


    def prepare_decode(self, slot_mapping: torch.Tensor, tables: np.ndarray, positions: np.ndarray,
                       block_size: int) -> PagedStep:
        """A step of decode rows only, row i at ``positions[i]`` with block table ``tables[i]``
        ([R, width] int32, 0 past each table's end): the persistent batch's rows, no per-row lists."""
        if block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size: the cpu_paged attention takes at most {MAX_BLOCK_SIZE}")
        rows = len(positions)
        return PagedStep(slot_mapping, torch.from_numpy(np.ascontiguousarray(tables)), torch.arange(rows),
                         torch.from_numpy(positions), torch.ones(rows, dtype=torch.int64), block_size, None)


def backend(all_rows: bool = False) -> PagedBackend:
    """The backend, its kernel loaded (built first if this machine has not built it yet);
    ``all_rows``: prefill chunks on the kernel too (batch-invariant mode)."""
    extension()
    return PagedBackend(all_rows)


if __name__ == "__main__":  # make install: build the kernel once for this machine
    extension()
    print(f"cpu_paged attention kernel built for this CPU from {SOURCE.name}")
