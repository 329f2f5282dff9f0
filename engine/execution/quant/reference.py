"""The torch reference of the quantized kernels: the gguf package's dequantizer (numpy, float32)
and a torch matmul. Slow (it dequantizes the whole weight per call); for tests and benchmarks."""

from __future__ import annotations

from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
import torch


def dequantize(raw: torch.Tensor, quant_type: GGMLQuantizationType) -> torch.Tensor:
    """raw [N, row bytes] uint8 blocks -> float32 [N, K], the gguf package's values."""
    return torch.from_numpy(gguf_dequantize(raw.numpy(), quant_type).copy())


def linear(x: torch.Tensor, raw: torch.Tensor, quant_type: GGMLQuantizationType) -> torch.Tensor:
    """x [M, K] @ dequantize(raw)^T -> [M, N] float32."""
    return x.float() @ dequantize(raw, quant_type).t()


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K whole blocks of 32) -> x' float32 [M, K]: each 32 values quantized to int8 as
    quant_gemv does (d = max|x| / 127, q = x * (1 / d) rounded to nearest, ties to even) and
    dequantized (q * d)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)  # [M, K / 32, 32]
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def gemv(x: torch.Tensor, raw: torch.Tensor, quant_type: GGMLQuantizationType) -> torch.Tensor:
    """The integer matrix-vector kernel's reference: int8_rows(x) @ dequantize(raw)^T, in float64 [M, N]."""
    return int8_rows(x).double() @ dequantize(raw, quant_type).double().t()
