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
