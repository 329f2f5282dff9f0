"""Fused elementwise kernels for CUDA, in Triton: each one pass over memory where torch takes several.

The profile that asked for them (an H200, a 1B Llama's prefill, benchmarks/RESULTS.md "GPU"):
elementwise passes and dtype copies took ~40% of the GPU's time beside the GEMMs' 48%: RMSNorm
as transformers writes it (upcast, square, mean, rsqrt, scale, downcast, weight: six passes), RoPE
(four half-size products and two sums), SiLU then the product with `up`, the residual adds.

- ``rms_norm``: RMSNorm of each row, optionally after adding a residual (the sum is rounded to the
  model's dtype and also returned: the next residual).
- ``silu_mul``: SiLU(gate) * up from the fused gate/up projection's output, into a new tensor.
- ``rope_``: rotary embedding of q's and k's heads in place (views of the fused qkv output are fine).

Each rounds where the torch reference (engine/execution/model.py) rounds: products and sums in
float32, rounded to the model's dtype at the same points, so the results are those of the
reference up to the last bit of a float32 sum's order or of rsqrt/exp. The tests compare the two
(tests/test_triton_ops.py, on the CPU under TRITON_INTERPRET=1); on the CPU the model keeps the
reference, since these run on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, add_ptr, out_ptr, residual_ptr, weight_ptr, eps, cols, stride_x, stride_add, stride_out,
              HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0)
    if HAS_ADD:  # the residual sum, rounded to the dtype as torch's add rounds it
        x = (x.to(tl.float32) + tl.load(add_ptr + row * stride_add + offsets, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * cols + offsets, x, mask=mask)
    x32 = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / cols + eps)
    normed = (x32 * inverse).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offsets, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, cols, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < cols
    gate = tl.load(gate_up_ptr + row * stride_in + offsets, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + cols + offsets, mask=mask, other=0.0).to(tl.float32)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * cols + offsets, (silu * up).to(gate.dtype), mask=mask)


@triton.jit
def _rope(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_q, stride_k, stride_table, num_q_heads, num_heads,
          HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """One program per token, all its heads of q then of k: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s],
    each product and sum rounded to the dtype as the reference's are."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]  # [Hp, 1]
    half = tl.arange(0, HALF_P)[None, :]  # [1, D/2p]
    base = tl.where(heads < num_q_heads, q_ptr + row * stride_q + heads * HEAD_DIM,
                    k_ptr + row * stride_k + (heads - num_q_heads) * HEAD_DIM)  # [Hp, 1] pointers
    mask = (heads < num_heads) & (half < HEAD_DIM // 2)
    c = tl.load(cos_ptr + row * stride_table + half, mask=half < HEAD_DIM // 2, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * stride_table + half, mask=half < HEAD_DIM // 2, other=0.0).to(tl.float32)
    x1 = tl.load(base + half, mask=mask, other=0.0)
    x2 = tl.load(base + HEAD_DIM // 2 + half, mask=mask, other=0.0)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = ((a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + half, out1, mask=mask)
    tl.store(base + HEAD_DIM // 2 + half, out2, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], weight [H] -> (RMSNorm(x + add) * weight, x + add); without ``add``,
    (RMSNorm(x) * weight, x)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    add = add if add is None or add.stride(-1) == 1 else add.contiguous()
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    residual = torch.empty_like(out) if add is not None else x
    if rows:
        _rms_norm[(rows,)](x, add if add is not None else x, out, residual, weight, eps, cols, x.stride(0),
                           (add if add is not None else x).stride(0), out.stride(0), HAS_ADD=add is not None,
                           BLOCK=triton.next_power_of_2(cols), num_warps=8 if cols >= 2048 else 4)
    return out, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate then up) -> SiLU(gate) * up [N, I]."""
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(cols), 2048)
    if rows:
        _silu_mul[(rows, triton.cdiv(cols, block))](gate_up, out, cols, gate_up.stride(0), BLOCK=block)
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [N, Hq, D], k [N, Hkv, D] (heads contiguous in a row), rotated in place by cos/sin [N, D]
    (each token's row of the tables; halves duplicated, as transformers' rotate_half expects)."""
    rows, num_q_heads, head_dim = q.shape
    num_heads = num_q_heads + k.shape[1]
    if rows:
        _rope[(rows,)](q, k, cos, sin, q.stride(0), k.stride(0), cos.stride(0), num_q_heads, num_heads,
                       HEAD_DIM=head_dim, HEADS_P=triton.next_power_of_2(num_heads),
                       HALF_P=triton.next_power_of_2(head_dim // 2))
