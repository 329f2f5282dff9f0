"""GGUF's quantized types multiplied as stored on a CUDA device, in Triton (issue 57, item 3).

- ``linear(x, raw, type)``: x [M, K] (float32 / float16 / bfloat16) @ W^T -> [M, N] float32, W [N, K]
  held as raw blocks [N, row bytes] uint8, each weight decoded from its block inside the kernel (in
  registers, never written back) and the products summed in float32;
- ``dequantize_rows(raw, type, k)``: whole rows decoded, for the quantized embedding's lookups.

Types: Q8_0, Q4_0, Q4_1 (blocks of 32 weights), Q4_K, Q6_K (super-blocks of 256), their byte
layouts as llama.cpp's ggml-quants.c and the gguf package's dequantizer (reference.py, the tests'
reference) read them. Each weight of a tile is located by its own index (block, position in it),
so a tile needs no alignment to the blocks: any K that is whole blocks, any N.

Rounding, as the C++ kernels round (quant/linear.py): for float16/bfloat16 rows the decoded weight
is rounded to the row's dtype and the dot product runs on the tensor cores with a float32
accumulator (vLLM's GGUF kernels do the same); float32 rows multiply float32 weights in IEEE
float32 (no TF32), the exactness dtype. Tested on the CPU under TRITON_INTERPRET=1
(tests/test_quant_triton.py); timed on a GPU by benchmarks/gpu_quant.py.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
import torch
import triton
import triton.language as tl

from engine.execution.attention.triton_paged import interpreted

TRITON_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                          GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
# The kernels' TYPE constant: the GGML type number.
Q4_0, Q4_1, Q8_0 = int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1), int(GGMLQuantizationType.Q8_0)
Q4_K, Q6_K = int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q6_K)
BLOCK_N, BLOCK_K = 64, 64


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _half(ptr):
    """The little-endian float16 at byte ``ptr`` (any even offset), as float32."""
    bits = (tl.load(ptr).to(tl.uint16) | (tl.load(ptr + 1).to(tl.uint16) << 8))
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _weights(row_ptr, k, TYPE: tl.constexpr):
    """The decoded weights W[n, k] (float32) of rows starting at byte ``row_ptr`` ([BN, 1] pointers)
    at positions ``k`` ([1, BK]), each product in the gguf package's order (its bits in float32);
    the caller clamps masked-off places to a valid k."""
    if TYPE == 8:  # Q8_0: 34 bytes: float16 d, 32 int8; w = d q
        block = row_ptr + (k // 32) * 34
        q = tl.load(block + 2 + k % 32).to(tl.int8, bitcast=True).to(tl.float32)
        w = _half(block) * q
    elif TYPE == 2:  # Q4_0: 18 bytes: float16 d, 16 bytes of nibbles (low: j < 16, high: j >= 16); w = d (q - 8)
        block = row_ptr + (k // 32) * 18
        j = k % 32
        q = (_byte(block + 2 + j % 16) >> ((j // 16) * 4)) & 15
        w = _half(block) * (q - 8).to(tl.float32)
    elif TYPE == 3:  # Q4_1: 20 bytes: float16 d, float16 m, 16 bytes of nibbles; w = d q + m
        block = row_ptr + (k // 32) * 20
        j = k % 32
        q = (_byte(block + 4 + j % 16) >> ((j // 16) * 4)) & 15
        w = _half(block) * q.to(tl.float32) + _half(block + 2)
    elif TYPE == 12:  # Q4_K: 144 bytes: float16 d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        block = row_ptr + (k // 256) * 144
        j = k % 256
        sub = j // 32  # 8 sub-blocks of 32; sub 2i and 2i+1 share the 32 bytes of chunk i (low, high nibble)
        q = (_byte(block + 16 + (j // 64) * 32 + j % 32) >> ((sub % 2) * 4)) & 15
        # llama.cpp's get_scale_min_k4 over the 12 bytes s: sub < 4: (s[sub] & 63, s[sub + 4] & 63);
        # else ((s[sub + 4] & 15) | (s[sub - 4] >> 6) << 4, (s[sub + 4] >> 4) | (s[sub] >> 6) << 4)
        a = _byte(block + 4 + sub)  # s[sub]
        b = _byte(block + 8 + sub)  # s[sub + 4]
        c = _byte(block + 4 + sub % 4)  # s[sub - 4] where sub >= 4
        high = sub >= 4
        scale = tl.where(high, (b & 15) | ((c >> 6) << 4), a & 63)
        minimum = tl.where(high, (b >> 4) | ((a >> 6) << 4), b & 63)
        w = (_half(block) * scale.to(tl.float32)) * q.to(tl.float32) - _half(block + 2) * minimum.to(tl.float32)
    else:  # Q6_K: 210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2), 16 int8 scales, float16 d
        block = row_ptr + (k // 256) * 210
        j = k % 256
        half = j // 128
        quarter = (j % 128) // 32  # which of the four values a (ql, qh) pair position holds
        position = j % 32
        low = (_byte(block + 64 * half + 32 * (quarter % 2) + position) >> ((quarter // 2) * 4)) & 15
        high = (_byte(block + 128 + 32 * half + position) >> (quarter * 2)) & 3
        scale = tl.load(block + 192 + 8 * half + position // 16 + 2 * quarter).to(tl.int8, bitcast=True)
        w = (_half(block + 208) * scale.to(tl.float32)) * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _linear(x_ptr, raw_ptr, out_ptr, M, N, K, row_bytes, stride_x, stride_out, TYPE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program per [BLOCK_M, BLOCK_N] tile of out = x @ W^T, over K in steps of BLOCK_K. DOT_FP32:
    16-bit operands multiplied as float32 (Triton's interpreter multiplies bfloat16's bits as integers)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BM, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    weight_rows = raw_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * row_bytes  # [BN, 1]: clamped, in bounds
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        x = tl.load(x_ptr + rows.to(tl.int64) * stride_x + k, mask=(rows < M) & (k < K), other=0.0)  # [BM, BK]
        w = _weights(weight_rows, tl.minimum(k, K - 1), TYPE)  # [BN, BK] float32
        w = tl.where(k < K, w, 0.0)
        if x.dtype == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        elif DOT_FP32:  # the same products: a 16-bit x 16-bit product is exact in float32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
        else:  # the weight rounded to the row's dtype, as the CPU kernels' bfloat16 path
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(out_ptr + rows.to(tl.int64) * stride_out + cols[None, :], acc, mask=(rows < M) & (cols[None, :] < N))


@triton.jit
def _dequantize(raw_ptr, out_ptr, K, row_bytes, TYPE: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (row, BLOCK_K values of it)."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
    w = _weights(raw_ptr + row * row_bytes + tl.zeros((1, 1), dtype=tl.int64), tl.minimum(k, K - 1), TYPE)
    tl.store(out_ptr + row * K + k, w, mask=k < K)


def _check(raw: torch.Tensor, quant_type: GGMLQuantizationType, k: int) -> None:
    if quant_type not in TRITON_TYPES:
        raise ValueError(f"no Triton kernel for GGUF type {quant_type.name}")
    values, nbytes = GGML_QUANT_SIZES[quant_type]
    if k % values or raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // values * nbytes:
        raise ValueError(f"raw {tuple(raw.shape)} {raw.dtype} is not rows of {k} {quant_type.name} weights")


def linear(x: torch.Tensor, raw: torch.Tensor, quant_type: GGMLQuantizationType,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] float32 (written into ``out``, [M, N] float32 with unit column
    stride, when given: a fused projection's segment writes its columns of one output)."""
    m, k = x.shape
    _check(raw, quant_type, k)
    n = raw.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device) if out is None else out
    if m and n:
        block_m = 16 if m <= 16 else 64  # decode's few rows: tl.dot's smallest tile; prefill: larger
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        _linear[grid](x, raw, out, m, n, k, raw.shape[1], x.stride(0), out.stride(0), TYPE=int(quant_type),
                      BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=interpreted())
    return out


def dequantize_rows(raw: torch.Tensor, quant_type: GGMLQuantizationType, k: int) -> torch.Tensor:
    """raw [R, row bytes] -> W [R, k] float32."""
    _check(raw, quant_type, k)
    out = torch.empty(raw.shape[0], k, dtype=torch.float32, device=raw.device)
    if raw.shape[0]:
        _dequantize[(raw.shape[0], triton.cdiv(k, BLOCK_K))](raw, out, k, raw.shape[1], TYPE=int(quant_type),
                                                            BLOCK_K=BLOCK_K)
    return out
