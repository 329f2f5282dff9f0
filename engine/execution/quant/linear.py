"""The model's modules over GGUF's quantized blocks, as the file stores them.

QuantizedLinear: y = x @ W^T (+ bias), W [out, in] held as raw blocks in one or more row segments
(a fused projection whose parts the file stores in different types: q/k/v, gate/up), each
multiplied by its type's kernel into its columns of one float32 output. QuantizedEmbedding: the
token table, looked up row by row, and the tied LM head.

Which path: the kernel, whose order per output depends on nothing but K (the same bits for a row
in any batch), in batch-invariant mode and for steps of up to DEQUANTIZE_ROWS rows (bfloat16 rows as
they are on an AVX512-BF16 CPU, two weights per lane and instruction; float32 rows otherwise). Larger
steps outside that mode (prefill chunks, wide batches) dequantize the weight once per call, to
bfloat16 where the CPU multiplies it natively, else to float32, and multiply with torch's GEMM
(oneDNN: AMX where present), faster there than the kernel's per-tile decode (float32: 1.1x at 32
rows, 1.8x at 128 on the EPYC; bfloat16: 1.8x at 32 rows, 4.5x at 128 on the AMX Xeon;
benchmarks/RESULTS.md, issue 57).
One bfloat16 row (a single stream's decode step) outside batch-invariant mode, over Q4_0 / Q4_1 /
Q8_0 weights, takes the integer kernel instead (csrc/quant_gemv.cpp: the row quantized to int8 per
32 values, as llama.cpp does): a row's bits then differ alone and in a batch, which only the
invariant mode promises. float32 rows never take it: float32 is the exactness dtype.

On a CUDA device (blocks moved there with the model) every call takes the Triton kernels instead
(triton_linear.py), for any number of rows and any dtype; ``invariant`` is a CPU mode (it needs the
cpu_paged attention) and changes nothing there.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType
import torch
from torch import nn
import torch.nn.functional as F

from engine.execution.quant import kernels


def uses_triton(raw: torch.Tensor) -> bool:
    """Whether blocks ``raw`` are multiplied by the Triton kernels (on a CUDA device) rather than the
    C++ ones. (The tests run the Triton path on the CPU, under Triton's interpreter, by patching this.)"""
    return raw.device.type == "cuda"


# Above this many rows outside batch-invariant mode (prefill chunks, wide batches) the weight is
# dequantized once per call and multiplied by torch's GEMM. float32: the kernel was faster up to 16,
# torch's GEMM from 32 (the EPYC, Q4_1 3072 x 576). bfloat16 on a CPU that multiplies it natively:
# W decoded to bfloat16 + oneDNN's bf16 GEMM (AMX where present) took 0.67 / 0.78 / 1.14 ms against
# the kernel's 0.85 / 1.41 / 5.10 ms for a SmolLM2-135M layer's four maps at 16 / 32 / 128 rows
# (the AMX Xeon, best of 9 on a loaded box; benchmarks/RESULTS.md, issue 57 session 7).
DEQUANTIZE_ROWS = 16
# Weights dequantized at once for that product (4 MB in bfloat16): a wider map (the LM head) goes in
# blocks of W's rows through one buffer that stays in cache (SmolLM2's tied Q8_0 head at 17 rows:
# 5.7 ms against 7.4-24.7 ms dequantized whole, and the kernel's 6.8-7.4 ms).
DEQUANTIZE_BLOCK_VALUES = 1 << 21


class QuantizedLinear(nn.Module):
    """A linear map over raw GGUF blocks; ``segments``: (type, raw [rows, row bytes] uint8) in output
    order, ``in_features`` the K every segment's rows hold; ``bias`` [out] or None (loaded later by
    the model's state dict like nn.Linear's)."""

    def __init__(self, segments: list[tuple[GGMLQuantizationType, torch.Tensor]], in_features: int,
                 bias: bool = False) -> None:
        super().__init__()
        merged: list[tuple[GGMLQuantizationType, list[torch.Tensor]]] = []
        for quant_type, raw in segments:  # neighbours of one type: one kernel call
            if merged and merged[-1][0] == quant_type:
                merged[-1][1].append(raw)
            else:
                merged.append((quant_type, [raw]))
        self.types = [quant_type for quant_type, _ in merged]
        self.sizes = []
        for i, (quant_type, raws) in enumerate(merged):
            raw = torch.cat(raws) if len(raws) > 1 else raws[0]
            self.register_buffer(f"raw{i}", raw.contiguous(), persistent=False)  # not in the state dict
            self.sizes.append(raw.shape[0])
        self.in_features, self.out_features = in_features, sum(self.sizes)
        self.type_numbers = [int(quant_type) for quant_type in self.types]
        self.integer_gemv = all(quant_type in kernels.INTEGER_GEMV_TYPES for quant_type in self.types)
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def raws(self) -> list[torch.Tensor]:
        buffers = self._buffers  # not getattr: nn.Module's lookup costs ~0.5 us a name, 121 maps a decode step
        return [buffers[f"raw{i}"] for i in range(len(self.types))]

    def stored_bytes(self) -> int:
        return sum(raw.numel() for raw in self.raws())

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in float32, or on the CPU in bfloat16 (the float32 weights rounded to nearest even)."""
        if uses_triton(self.raw0):
            return torch.cat([dequantize_rows(raw, quant_type, self.in_features)
                              for quant_type, raw in zip(self.types, self.raws())])
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype)
        start = 0
        for quant_type, raw, size in zip(self.types, self.raws(), self.sizes):  # each segment into its rows
            kernels.build().dequantize_into(raw, int(quant_type), weight.narrow(0, start, size))
            start += size
        return weight

    def _dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] (float32 or bfloat16) @ W^T by torch's GEMM, W dequantized to x's dtype on the CPU:
        whole when it has at most DEQUANTIZE_BLOCK_VALUES weights ([M, out]), else block by block into
        one buffer that stays in cache (a wide LM head: [M, out], a transposed view)."""
        rows_per_block = max(1, DEQUANTIZE_BLOCK_VALUES // self.in_features)
        if self.out_features <= rows_per_block:
            return F.linear(x, self.dequantized(x.dtype))
        out = x.new_empty(self.out_features, x.shape[0])  # [out, M]: each block's product lands in its rows
        buffer = x.new_empty(rows_per_block, self.in_features)
        start = 0
        for quant_type, raw, size in zip(self.types, self.raws(), self.sizes):
            for first in range(0, size, rows_per_block):
                count = min(rows_per_block, size - first)
                weight = buffer[:count]
                kernels.build().dequantize_into(raw[first:first + count], int(quant_type), weight)
                torch.mm(weight, x.t(), out=out[start + first:start + first + count])
            start += size
        return out.t()

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype, summed in float32."""
        raws = self.raws()
        if uses_triton(raws[0]):
            from engine.execution.quant import triton_linear  # triton: on CUDA (a CUDA build of torch brings it)

            out = x.new_empty(x.shape[0], self.out_features, dtype=torch.float32)  # [M, out]: segments fill columns
            start = 0
            for quant_type, raw, size in zip(self.types, raws, self.sizes):
                triton_linear.linear(x, raw, quant_type, out.narrow(1, start, size))
                start += size
            out = out.to(x.dtype)
            return out + self.bias if self.bias is not None else out
        ext = kernels.build()
        if x.shape[0] == 1 and self.integer_gemv and x.dtype == torch.bfloat16 and not invariant:
            out = x.new_empty(1, self.out_features)  # [1, out] bfloat16, written by the kernel
            ext.quant_gemv(x.contiguous(), raws, self.type_numbers, out)
            return out + self.bias if self.bias is not None else out
        bf16_dot = x.dtype == torch.bfloat16 and ext.has_bf16_dot()  # the CPU multiplies bfloat16 natively
        if x.shape[0] > DEQUANTIZE_ROWS and not invariant:  # W decoded once, then torch's GEMM
            out = self._dequantized_product(x) if bf16_dot else self._dequantized_product(x.float()).to(x.dtype)
            return out + self.bias if self.bias is not None else out
        rows = x.contiguous() if bf16_dot else x.float().contiguous()  # the kernel multiplies bfloat16 rows as they are
        out = rows.new_empty(x.shape[0], self.out_features, dtype=torch.float32)  # [M, out]: segments fill columns
        start = 0
        for quant_type, raw, size in zip(self.types, raws, self.sizes):
            ext.quant_linear(rows, raw, int(quant_type), out.narrow(1, start, size))
            start += size
        out = out.to(x.dtype)
        return out + self.bias if self.bias is not None else out


class QuantizedEmbedding(nn.Module):
    """The token table [vocab, hidden] as raw blocks: lookups dequantize their rows to ``dtype``;
    ``table`` is the same blocks as a QuantizedLinear (the tied LM head)."""

    def __init__(self, quant_type: GGMLQuantizationType, raw: torch.Tensor, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = QuantizedLinear([(quant_type, raw)], hidden)
        self.quant_type, self.dtype = quant_type, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> [N, hidden] in ``dtype``."""
        rows = self.table.raw0.index_select(0, input_ids)  # [N, row bytes]
        return dequantize_rows(rows, self.quant_type, self.table.in_features).to(self.dtype)


def dequantize_rows(raw: torch.Tensor, quant_type: GGMLQuantizationType, in_features: int) -> torch.Tensor:
    """raw [R, row bytes] -> [R, in_features] float32, by the kernels of the blocks' device."""
    if uses_triton(raw):
        from engine.execution.quant import triton_linear

        return triton_linear.dequantize_rows(raw, quant_type, in_features)
    return kernels.build().dequantize_rows(raw, int(quant_type), in_features)
