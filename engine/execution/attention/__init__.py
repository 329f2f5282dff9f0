"""Attention over the paged KV cache, by backend name.

The KV cache of one layer is a flat pool of slots, [num_blocks * block_size, kv_heads, head_dim];
token i of a sequence lives in slot block_table[i // B] * B + i % B. One engine step's tokens
are a flat batch of N tokens: each sequence of the step brings a run of consecutive positions
(one for a decode, several for a prefill chunk or a verification of drafts), described by an
``AttentionSeq``. Each backend turns the step's sequences into its own metadata once per step
(``prepare``), and that object's ``attend`` runs one layer: it writes the new tokens' K/V into
their slots, then attends.

Backends (one file each):
- ``torch_sdpa``: the readable reference. Gathers each decoding sequence's blocks into a padded
  copy and calls torch's scaled_dot_product_attention; any device, any dtype.
- ``cpu_paged``: a C++ kernel that reads the pool in place, one call per layer per step, with a
  fixed reduction order over keys (batch- and chunking-invariant). CPU; float32, bfloat16,
  float16. It takes the decodes, and in batch-invariant mode the prefill chunks too (otherwise
  they go to torch's flash SDPA, faster on long query blocks).
- ``triton_paged``: Triton kernels that read the pool in place, one launch per layer per step for
  every row (decodes and prefill chunks, varlen), GQA without repeated K/V. CUDA; float32,
  bfloat16, float16. Its launches take no host sync, so decode steps replay as CUDA graphs
  (engine/execution/cuda_graphs.py). On the CPU it runs only under Triton's interpreter
  (``TRITON_INTERPRET=1``): how the tests run its source.
``auto`` picks ``triton_paged`` on CUDA, ``cpu_paged`` on a CPU where it runs (a CPU, one of its
dtypes, the kernel built), else ``torch_sdpa``: on a 32 x 2,048-token decode step the CPU kernel
takes a fifth of the reference's time (the reference copies every block into a padded gather
first; benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Protocol

import numpy as np
import torch

from engine.config import ATTENTION_BACKENDS


@dataclass(frozen=True)
class AttentionSeq:
    """One sequence's rows in a step: positions [start_pos, start_pos + num_tokens) at flat
    rows [flat_start, flat_start + num_tokens); ``block_table`` covers every one of them."""

    flat_start: int
    num_tokens: int
    start_pos: int
    block_table: list[int]


def fill_block_tables(out: np.ndarray, tables: list[list[int]] | np.ndarray) -> np.ndarray:
    """Write ``tables`` (one block table per sequence) into the rows of ``out`` [n, width],
    zero past each table's end; returns ``out``. One pass over the ids in C (a per-row numpy
    copy costs more than the copy at decode-step sizes: 256 rows of ~36 blocks each). An array
    [n, w] (the persistent batch's rows, 0 past each table's end) is copied as it is."""
    if isinstance(tables, np.ndarray):
        width = min(out.shape[1], tables.shape[1])
        out[:, :width] = tables[:, :width]
        out[:, width:] = 0
        return out
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=out.dtype, count=int(lengths.sum()))
    out[...] = 0
    out[np.arange(out.shape[1]) < lengths[:, None]] = flat
    return out


class StepAttention(Protocol):
    """A backend's metadata for one step, shared by every layer."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, window: int | None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] of the step's new tokens; k_cache/v_cache [S, Hkv, D],
        written in place at the new tokens' slots. Returns [N, Hq, D]."""
        ...


class AttentionBackend(Protocol):
    name: str

    def prepare(self, slot_mapping: torch.Tensor, seqs: list[AttentionSeq], windows: set[int | None],
                block_size: int, device: torch.device) -> StepAttention:
        """slot_mapping [N] on the device: the slot of each new token; ``windows``: the model's
        sliding windows (None = full attention)."""
        ...


def batch_invariant_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine on ``device`` in ``dtype`` can be batch-invariant: it needs cpu_paged, built."""
    from engine.execution.attention import cpu_paged

    return device.type == "cpu" and dtype in cpu_paged.DTYPES and cpu_paged.available()


def batch_invariant_by_default(device: torch.device, dtype: torch.dtype, quantized: bool = False) -> bool:
    """Whether an engine asked for no mode is batch-invariant (docs/sampling.md): wherever it can be,
    but in a 16-bit dtype on a CPU that multiplies it natively (AMX, AVX512-BF16) only in bfloat16
    with the invariant GEMM on the CPU's own dot-product instructions (csrc/invariant_linear.cpp)
    and weights in that dtype. There the mode costs <= 6% (benchmarks/RESULTS.md, issue 57); on its
    float32 lanes it cost 31-62% against oneDNN's bf16 kernels (issue 40), and with weights kept
    quantized (``quantized``: a GGUF's blocks, int8) it gives up the one-row integer kernel: 25% of
    a single stream."""
    from engine.execution import fused_ops
    from engine.execution.loader import native_bf16

    if not batch_invariant_supported(device, dtype):  # first: it asks nothing of the CPU's kernels off the CPU
        return False
    if dtype != torch.float32 and native_bf16(device):
        dot_gemm = dtype == torch.bfloat16 and fused_ops.available() and fused_ops.extension().invariant_linear_bf16_dot()
        return dot_gemm and not quantized
    return True


def select_backend(name: str, device: torch.device, dtype: torch.dtype,
                   batch_invariant: bool = False, group: int = 1) -> AttentionBackend:
    """The backend called ``name``; for "auto", triton_paged on CUDA, cpu_paged on a CPU where it
    runs (the faster), else torch_sdpa. ``batch_invariant`` needs the one whose order over keys is
    fixed: cpu_paged, on every row. ``group``: the model's query heads per KV head."""
    from engine.execution.attention import cpu_paged, torch_sdpa

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch_sdpa":
        return torch_sdpa.BACKEND
    if name == "triton_paged" or (name == "auto" and device.type == "cuda" and not batch_invariant):
        return _triton_backend(device, dtype, group, named=name == "triton_paged")
    if name == "auto" and not batch_invariant:  # cpu_paged wherever it runs: where it could be batch-invariant
        return cpu_paged.backend(all_rows=False) if batch_invariant_supported(device, dtype) else torch_sdpa.BACKEND
    # cpu_paged, by name or because batch invariance needs it
    if not (device.type == "cpu" and dtype in cpu_paged.DTYPES):
        raise ValueError(f"attention_backend: cpu_paged (which batch_invariant needs) runs on the CPU in "
                         f"{', '.join(str(d) for d in cpu_paged.DTYPES)}, not on {device} in {dtype}")
    return cpu_paged.backend(all_rows=batch_invariant)


def _triton_backend(device: torch.device, dtype: torch.dtype, group: int, named: bool) -> AttentionBackend:
    """triton_paged where it can run: CUDA (or the CPU under Triton's interpreter), one of its
    dtypes, Triton importable. Asked for by name, anything else is an error naming the setting;
    chosen by "auto", the reference instead, with a warning."""
    import logging
    import os

    from engine.execution.attention import torch_sdpa

    reason = None
    if not (device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        reason = f"runs on CUDA, not on {device} (on a CPU only under TRITON_INTERPRET=1, for tests)"
    elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reason = f"takes float32, bfloat16 or float16, not {dtype}"
    else:
        try:
            from engine.execution.attention import triton_paged
        except ImportError as error:
            reason = f"needs Triton ({error})"
    if reason is not None:
        if named:
            raise ValueError(f"attention_backend: triton_paged {reason}")
        logging.getLogger(__name__).warning("attention: triton_paged %s; using torch_sdpa", reason)
        return torch_sdpa.BACKEND
    return triton_paged.TritonPagedBackend(group)
