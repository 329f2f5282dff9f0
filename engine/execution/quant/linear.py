"""The model's modules over GGUF's quantized blocks, as the file stores them.

QuantizedLinear: y = x @ W^T (+ bias), W [out, in] held as raw blocks in one or more row segments
(a fused projection whose parts the file stores in different types: q/k/v, gate/up), each
multiplied by its type's kernel into its columns of one float32 output. QuantizedEmbedding: the
token table, looked up row by row, and the tied LM head.

Which path: the kernel, whose order per output depends on nothing but K (the same bits for a row
in any batch), for bfloat16 rows on an AVX512-BF16 CPU (two weights per lane and instruction:
1.2-1.3x torch's bf16 GEMM time at 32-128 rows), and for float32 rows in steps of up to
DEQUANTIZE_ROWS rows or in batch-invariant mode. Larger float32 steps outside that mode (prefill
chunks) dequantize the weight once per call and multiply with torch's GEMM, faster there than the
kernel's float32 multiply-adds (1.1x at 32 rows, 1.8x at 128; benchmarks/RESULTS.md, issue 57).
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


DEQUANTIZE_ROWS = 16  # float32 rows: the kernel was faster up to 16, torch's GEMM from 32 (the EPYC, Q4_1 3072 x 576)


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
        return [getattr(self, f"raw{i}") for i in range(len(self.types))]

    def stored_bytes(self) -> int:
        return sum(raw.numel() for raw in self.raws())

    def dequantized(self) -> torch.Tensor:
        """W [out, in] float32."""
        return torch.cat([dequantize_rows(raw, quant_type, self.in_features)
                          for quant_type, raw in zip(self.types, self.raws())])

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype, summed in float32."""
        if uses_triton(self.raw0):
            from engine.execution.quant import triton_linear  # triton: on CUDA (a CUDA build of torch brings it)

            out = x.new_empty(x.shape[0], self.out_features, dtype=torch.float32)  # [M, out]: segments fill columns
            start = 0
            for quant_type, raw, size in zip(self.types, self.raws(), self.sizes):
                triton_linear.linear(x, raw, quant_type, out.narrow(1, start, size))
                start += size
            out = out.to(x.dtype)
            return out + self.bias if self.bias is not None else out
        ext = kernels.build()
        if x.dtype == torch.bfloat16 and x.shape[0] == 1 and self.integer_gemv and not invariant:
            out = x.new_empty(1, self.out_features)  # [1, out] bfloat16, written by the kernel
            ext.quant_gemv(x.contiguous(), self.raws(), self.type_numbers, out)
            return out + self.bias if self.bias is not None else out
        if x.dtype == torch.bfloat16 and ext.has_bf16_dot():
            rows = x.contiguous()  # the kernel multiplies bfloat16 rows as they are
        else:
            rows = x.float().contiguous()
            if rows.shape[0] > DEQUANTIZE_ROWS and not invariant:
                out = F.linear(rows, self.dequantized()).to(x.dtype)
                return out + self.bias if self.bias is not None else out
        out = rows.new_empty(x.shape[0], self.out_features, dtype=torch.float32)  # [M, out]: segments fill columns
        start = 0
        for quant_type, raw, size in zip(self.types, self.raws(), self.sizes):
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
