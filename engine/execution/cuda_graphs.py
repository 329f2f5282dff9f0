"""CUDA graphs for decode steps: the forward and the LM head, captured once per padded batch size.

A decode step launches some 15 kernels per layer; from Python each launch costs more than the
GPU's work on a few hundred rows, so an eager decode step is launch-bound. A graph replays the
whole step in one launch. It replays what it captured: the same kernels on the same memory, so
the step's inputs live in buffers allocated once (ids, positions, slots and the attention
metadata of triton_paged), written before each replay with two host-to-device copies.

Which steps: every row a decode (one new token per sequence, no drafts, no LoRA, no prompt
table, no prompt logprobs or context logits: ``ModelRunner`` decides), at most the largest size
captured. A step of n rows replays the smallest graph of at least n rows; the padding rows write
no KV (slot -1) and their sequences have no new tokens (the kernel skips them). Prefill and mixed
steps run eagerly. The sizes follow vLLM's: 1, 2, 4, then multiples of 8 and 16 up to the
largest batch (``max_cuda_graph_batch``); all share one memory pool, captured largest first.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.execution.attention import fill_block_tables
from engine.execution.attention.triton_paged import TritonStep, tile_tokens

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured, ascending: 1, 2, 4, 8, 16, 24, 32, then every 16, up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4, *range(8, 33, 8), *range(48, max_batch + 1, 16)) if s <= max_batch]
    return sizes if sizes and sizes[-1] == max_batch else sizes + [max_batch]


def meta_views(buffer: torch.Tensor, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tables [size, width], seq_info [size, 3], work [size, 2]: views of the int32 ``buffer``."""
    tables, seq_info, work, _ = buffer.split([size * width, size * 3, size * 2, buffer.numel() - size * (width + 5)])
    return tables.view(size, width), seq_info.view(size, 3), work.view(size, 2)


class GraphInputs:
    """A decode graph's inputs on the host, written once per step for its padded size: ids,
    positions, slots [3, largest] int64 and the attention metadata (block tables, seq_info,
    work) int32, laid out as the device buffers the graphs read. Pinned on CUDA, so that the
    copies to the device are asynchronous; no device needed to fill them."""

    def __init__(self, largest: int, table_width: int, pinned: bool) -> None:
        self.table_width = table_width
        self.tokens = torch.zeros(3, largest, dtype=torch.int64, pin_memory=pinned)  # ids, positions, slots
        self.meta = torch.zeros(largest * (table_width + 5), dtype=torch.int32, pin_memory=pinned)

    def fill(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
             tables: list[list[int]] | np.ndarray, size: int) -> int:
        """Rows [0, n) from the step's n = len(tables) decode rows (row i: its token, position,
        slot and block table), rows [n, size) padding (slot -1, no new tokens); returns the
        metadata's used length (int32 elements from the start of ``meta``)."""
        n = len(tables)
        host = self.tokens.numpy()
        host[0, :n], host[1, :n], host[2, :n] = ids, positions, slots
        host[:2, n:size], host[2, n:size] = 0, -1
        table_rows, seq_info, work = (v.numpy() for v in meta_views(self.meta, size, self.table_width))
        fill_block_tables(table_rows[:n], tables)
        table_rows[n:] = 0
        seq_info[:, 0] = np.arange(size)
        seq_info[:n, 1], seq_info[n:, 1] = 1, 0
        seq_info[:n, 2] = positions
        seq_info[n:, 2] = 0
        work[:, 0], work[:, 1] = np.arange(size), 0
        return size * (self.table_width + 5)


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_batch: int, table_width: int,
                 group: int) -> None:
        """``table_width``: the longest block table a sequence can have (max_model_len / block_size)."""
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.sizes = capture_sizes(max_batch)
        self.block_q = tile_tokens(group, prefill=False)  # a work item per sequence: its one token
        device = kv_cache.device
        largest = self.sizes[-1]
        self.table_width = table_width
        # Host staging, pinned (asynchronous copies), and the device buffers the graphs read.
        self._host = GraphInputs(largest, table_width, pinned=True)
        self._inputs = torch.zeros(3, largest, dtype=torch.int64, device=device)
        self._meta = torch.zeros(self._host.meta.numel(), dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    def _step(self, size: int) -> TritonStep:
        tables, seq_info, work = meta_views(self._meta, size, self.table_width)
        return TritonStep(self._inputs[2, :size], tables, seq_info, work, self.block_q, self.block_size)

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions = self._inputs[0, :size], self._inputs[1, :size]
        hidden = self.model(ids, positions, self._step(size), self.kv_cache)  # [size, H]
        return self.model.compute_logits(hidden)  # [size, V]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool; logs the time and the memory."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        self._write_padding(self.sizes[-1])
        pool = None
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graphs asks
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)  # compiles Triton's kernels and settles cuBLAS's choices
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before
        log.info("cuda graphs: %d decode sizes up to %d rows captured in %.1f s, %.0f MiB", len(self.sizes),
                 self.sizes[-1], time.perf_counter() - start, self.pool_bytes / (1 << 20))

    def _write_padding(self, size: int) -> None:
        """Every row padding: slot -1, no new tokens (what capture runs on)."""
        self._inputs[:, :size] = 0
        self._inputs[2, :size] = -1
        tables, seq_info, work = meta_views(self._meta, size, self.table_width)
        tables.zero_()
        seq_info.zero_()
        work[:, 0] = torch.arange(size, dtype=torch.int32, device=work.device)
        work[:, 1] = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: list[list[int]] | np.ndarray
            ) -> torch.Tensor:
        """The logits [n, V] of a decode step of n = len(tables) <= max_batch rows (row i: token
        ids[i] at positions[i], written to slots[i], with block table tables[i]: lists, or the
        persistent batch's rows [n, width] int32)."""
        n = len(tables)
        size = next(s for s in self.sizes if s >= n)
        used = self._host.fill(ids, positions, slots, tables, size)
        self._inputs[:, :size].copy_(self._host.tokens[:, :size], non_blocking=True)
        self._meta[:used].copy_(self._host.meta[:used], non_blocking=True)
        self._graphs[size].replay()
        return self._logits[size][:n]
