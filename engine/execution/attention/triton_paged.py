"""The CUDA backend: Triton kernels that read and write the KV pool in place.

Per layer and step, two launches cover every row of the step, decodes and prefill chunks alike:

- ``_store_kv``: the new tokens' K and V into their slots (a slot < 0 is a padding row of a CUDA
  graph and is skipped);
- ``_paged_attention``: one program per (work item, KV head). A work item is BLOCK_Q consecutive
  new tokens of one sequence; the program packs those tokens times the GROUP query heads that
  share the KV head into the M rows of one tile (GQA without repeating K/V: K and V are read
  once for the whole group), then walks the sequence's keys BLOCK_N at a time through its block
  table — the cached prefix before the chunk, then the chunk itself, causal — with an online
  softmax in float32 (FlashAttention-2's recurrence) and a sliding window where the layer has one.

The torch reference is ``torch_sdpa`` (the tests compare the two on the same pool, on the CPU
under ``TRITON_INTERPRET=1``, which runs these kernels' source with numpy). In float32 the dots
run in IEEE precision (no TF32), so float32 parity with transformers holds on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from engine.execution.attention import AttentionSeq, fill_block_tables

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
# Launch settings per kind of step: (keys per inner iteration, warps, pipeline stages), the best
# of benchmarks/gpu.py's sweep on an H200 (a 1B Llama's layer, head size 64: decode 151 us against
# 170 us for (64, 4, 2); prefill 177 against 190; benchmarks/RESULTS.md "GPU"). The keys per
# iteration are independent of the pool's block size. A prefill tile with heads wider than 64
# takes at least 8 warps.
LAUNCH = {"decode": (128, 2, 3), "prefill": (64, 8, 2)}
# Query rows (tokens x heads of a group) per program: small for decode steps (one token per
# sequence: the tile is mostly the group's heads), large for prefill chunks (tensor-core tiles).
DECODE_ROWS = 16
PREFILL_ROWS = 128
STORE_TOKENS = 16  # new tokens whose K/V one program of _store_kv writes


def interpreted() -> bool:
    """Whether Triton runs kernels through its interpreter (CPU tensors; tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_rows, stride_k, stride_v, stride_cache,
              ROW: tl.constexpr, ROW_P: tl.constexpr, TOKENS: tl.constexpr):
    """TOKENS new tokens' K and V rows ([Hkv * D], contiguous) into their slots; a slot < 0 is skipped."""
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_rows, other=-1)
    cols = tl.arange(0, ROW_P)
    mask = (slots >= 0)[:, None] & (cols < ROW)[None, :]
    k = tl.load(k_ptr + tokens[:, None].to(tl.int64) * stride_k + cols[None, :], mask=mask)
    v = tl.load(v_ptr + tokens[:, None].to(tl.int64) * stride_v + cols[None, :], mask=mask)
    tl.store(k_cache_ptr + slots[:, None] * stride_cache + cols[None, :], k, mask=mask)
    tl.store(v_cache_ptr + slots[:, None] * stride_cache + cols[None, :], v, mask=mask)


@triton.jit
def _paged_attention(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_info_ptr, work_ptr,
                     scale_log2e, window, stride_qn, stride_qh, stride_on, stride_oh, stride_cs, stride_ch,
                     stride_table, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """seq_info [T, 3]: first flat row, new tokens, position of the first new token; work [W, 2]:
    (sequence, block of BLOCK_Q new tokens); tables [T, MB]. window 0: full attention. DOT_FP32:
    the dots' operands in float32 (the interpreter multiplies bfloat16's bits as integers; on a GPU
    a bf16 x bf16 product is exact in float32, so the results are the same)."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(work_ptr + 2 * item)
    q_block = tl.load(work_ptr + 2 * item + 1)
    first_row = tl.load(seq_info_ptr + 3 * seq)
    num_new = tl.load(seq_info_ptr + 3 * seq + 1)
    start_pos = tl.load(seq_info_ptr + 3 * seq + 2)

    M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, M)
    token = q_block * BLOCK_Q + rows // GROUP_P  # [M] the row's token within the sequence's new ones
    head = kv_head * GROUP + rows % GROUP_P  # [M] its query head
    row_ok = (token < num_new) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_offsets = (first_row + token)[:, None].to(tl.int64) * stride_qn + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, Dp]
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = start_pos + token  # [M]

    # Keys [key_lo, key_hi): up to the tile's last query, from its first query's window.
    key_hi = start_pos + tl.minimum(num_new, (q_block + 1) * BLOCK_Q)
    key_lo = 0
    if window > 0:
        key_lo = tl.maximum(start_pos + q_block * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM_P], tl.float32)
    for start in range(key_lo, key_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [N] positions
        key_ok = keys < key_hi
        block = tl.load(tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slots = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_offsets = slots[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [N, Dp]
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [M, N] float32, log2 units
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        visible &= (window == 0) | (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [N, Dp]
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offsets = (first_row + token)[:, None].to(tl.int64) * stride_on + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def tile_tokens(group: int, prefill: bool) -> int:
    """BLOCK_Q: new tokens per program, so that tokens x padded group heads fill the tile's rows."""
    rows = PREFILL_ROWS if prefill else DECODE_ROWS
    return max(rows // triton.next_power_of_2(group), 1)


@dataclass
class StepPlan:
    """A step's attention metadata on the host, int32: what ``TritonStep`` reads on the device."""

    tables: np.ndarray  # [T, MB] block tables, 0-padded
    seq_info: np.ndarray  # [T, 3] first flat row, new tokens, position of the first new token
    work: np.ndarray  # [W, 2] (sequence, block of block_q new tokens)
    block_q: int


def plan_step(seqs: list[AttentionSeq], block_q: int, table_width: int | None = None) -> StepPlan:
    """The step's metadata: one work item per ``block_q`` new tokens of each sequence."""
    width = table_width or max((len(s.block_table) for s in seqs), default=1)
    tables = fill_block_tables(np.empty((len(seqs), width), dtype=np.int32), [s.block_table for s in seqs])
    seq_info = np.array([(s.flat_start, s.num_tokens, s.start_pos) for s in seqs], dtype=np.int32).reshape(-1, 3)
    per_seq = -(-seq_info[:, 1] // block_q)  # work items of each sequence
    work = np.empty((int(per_seq.sum()), 2), dtype=np.int32)
    work[:, 0] = np.repeat(np.arange(len(seqs), dtype=np.int32), per_seq)
    work[:, 1] = np.arange(len(work), dtype=np.int32) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    return StepPlan(tables, seq_info, work, block_q)


@dataclass
class TritonStep:
    slot_mapping: torch.Tensor  # [N] int64 slot of each new token; < 0: skipped (graph padding)
    tables: torch.Tensor  # [T, MB] int32
    seq_info: torch.Tensor  # [T, 3] int32
    work: torch.Tensor  # [W, 2] int32
    block_q: int
    block_size: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, window: int | None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D]; k_cache/v_cache [S, Hkv, D]. Returns [N, Hq, D]."""
        num_rows, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        row = num_kv_heads * head_dim
        if num_rows:
            _store_kv[(triton.cdiv(num_rows, STORE_TOKENS),)](
                k, v, k_cache, v_cache, self.slot_mapping, num_rows, k.stride(0), v.stride(0), k_cache.stride(0),
                ROW=row, ROW_P=triton.next_power_of_2(row), TOKENS=STORE_TOKENS)
        out = torch.empty_like(q)
        if not len(self.work):
            return out
        group = num_heads // num_kv_heads
        prefill = self.block_q > tile_tokens(group, prefill=False)
        block_n, warps, stages = LAUNCH["prefill" if prefill else "decode"]
        warps = max(warps, 8) if prefill and head_dim > 64 else warps
        _paged_attention[(len(self.work), num_kv_heads)](
            out, q, k_cache, v_cache, self.tables, self.seq_info, self.work,
            head_dim ** -0.5 * math.log2(math.e), window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            self.tables.stride(0), GROUP=group, GROUP_P=triton.next_power_of_2(group), BLOCK_Q=self.block_q,
            BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=self.block_size,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_FP32=interpreted(),
            num_warps=warps, num_stages=stages)
        return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] whose rows are [H * D] contiguous (a view of the fused qkv projection is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


class TritonPagedBackend:
    name = "triton_paged"

    def __init__(self, group: int = 1) -> None:
        """``group``: the model's query heads per KV head, which sizes the tiles."""
        self.group = group

    def prepare(self, slot_mapping: torch.Tensor, seqs: list[AttentionSeq], windows: set[int | None],
                block_size: int, device: torch.device) -> TritonStep:
        plan = plan_step(seqs, tile_tokens(self.group, prefill=any(s.num_tokens > 1 for s in seqs)))
        return upload(plan, slot_mapping, block_size, device)


def upload(plan: StepPlan, slot_mapping: torch.Tensor, block_size: int, device: torch.device) -> TritonStep:
    """The plan on ``device`` in one host-to-device copy."""
    packed = np.concatenate([plan.tables.ravel(), plan.seq_info.ravel(), plan.work.ravel()])
    on_device = torch.from_numpy(packed).to(device, non_blocking=True)
    tables, seq_info, work = on_device.split([plan.tables.size, plan.seq_info.size, plan.work.size])
    return TritonStep(slot_mapping, tables.view(plan.tables.shape), seq_info.view(-1, 3), work.view(-1, 2),
                      plan.block_q, block_size)
