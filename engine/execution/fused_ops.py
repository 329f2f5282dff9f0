"""The decoder's elementwise work (RMSNorm with the residual add, RoPE on q and k, SiLU * up) and
its batch-invariant matmul.

Each op has two implementations, picked by the tensor's device:
- on the CPU (float32, bfloat16, float16), a C++ kernel that makes one pass over the memory
  (csrc/fused_ops.cpp; the matmul in csrc/invariant_linear.cpp), compiled for this machine's CPU
  (-march=native) by ``make install`` (``python -m engine.execution.fused_ops``; engine/execution/extensions.py);
- elsewhere (CUDA, NPU), or where the kernel cannot be built, the torch reference beside it:
  transformers' formulas operation for operation, out of place (what CUDA graphs capture today).
tests/test_fused_ops.py compares the two. Which bits each promises (docs/architecture.md): RoPE
and the residual add are the reference's bits in every dtype; SiLU differs from torch's by its
exp (~2 ulp) and RMSNorm by the order of its sum of squares (a fixed order per row, so every
kernel stays batch-invariant). The matmul sums each output in one fixed order (close to
torch.mm, not its bits). Nothing here reads a tensor's values on the host.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.execution.extensions import build_extension

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("fused_ops.cpp", "invariant_linear.cpp")]


CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math"]
# Builds for another ISA than this CPU's full one: "avx2" is a CPU without AVX-512 (so without
# AVX512-BF16: invariant_linear's float32-lane path for bfloat16), for tests and benchmarks.
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}


@cache
def extension(isa: str = "native"):
    """The compiled kernels, built on first use (a minute on 2 cores) and kept (engine/execution/extensions.py);
    ``isa`` other than "native": the same sources with ``ISA_FLAGS[isa]`` added (a separate build)."""
    suffix = "" if isa == "native" else f"_{isa}"
    return build_extension(f"pdserve_fused_ops{suffix}", SOURCES, CFLAGS + ISA_FLAGS[isa])


@cache
def available() -> bool:
    """Whether the kernels build and load here; if not, every op runs its torch reference."""
    try:
        extension()
    except Exception as error:  # a missing compiler, an unsupported platform
        log.warning("fused ops: the C++ kernels are unavailable (%s); using the torch references", error)
        return False
    return True


_kernels_enabled = True


def set_kernels_enabled(enabled: bool) -> None:
    """Off: every op runs its torch reference, on the CPU too (benchmarks' before/after, tests
    that compare a whole model both ways). On by default."""
    global _kernels_enabled
    _kernels_enabled = enabled


def _on_kernel(x: torch.Tensor) -> bool:
    return _kernels_enabled and x.device.type == "cpu" and x.dtype in DTYPES and available()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm operation for operation (tests/test_model_ops.py: the same bits);
    x [..., H] -> a new tensor, in the wider of x's and weight's dtypes, as transformers' product."""
    x32 = x.to(torch.float32)
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if normed.dtype != weight.dtype:
        return weight * normed
    return normed.mul_(weight)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and its norm: (x + delta, rms_norm(x + delta) * weight); without
    ``delta``, (x, rms_norm(x) * weight). x, delta [N, H]. On the kernel the sum is written into
    ``x`` itself (the caller's residual stream, so it must own it); use the returned tensor."""
    if _on_kernel(x) and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype:
        out = torch.empty_like(x)
        extension().add_rms_norm_(x, delta, weight, out, eps)
        return x, out
    if delta is not None:
        x = x + delta
    return x, rms_norm_reference(x, weight, eps)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, D] (halves duplicated, as transformers' rotate_half expects).

    transformers' ``x * cos + rotate_half(x) * sin`` half by half, without building rotate_half(x):
    x1 * c - x2 * s and x2 * c + x1 * s are the same roundings in the same order (negation is
    exact), so the same bits, with two half-size temporaries instead of four full ones."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [N, H, D/2]
    c, s = cos[:, None, :half], sin[:, None, :half]  # [N, 1, D/2]: both halves of the tables are equal
    out = torch.empty_like(x)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=out1).sub_(x2 * s)
    torch.mul(x2, c, out=out2).add_(x1 * s)
    return out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hkv, D] rotated; cos/sin [N, D]. On the kernel in place (q and k may be
    views of one projection's output), else new tensors; the reference's bits either way."""
    if _on_kernel(q) and cos.stride(-1) == 1 and cos.stride() == sin.stride() and cos.dtype == q.dtype:
        extension().rope_(q, k, cos, sin)
        return q, k
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] -> silu(gate) * up [N, I], written over gate_up's first half (no new [N, I] tensor)."""
    inter = gate_up.shape[-1] // 2
    if _on_kernel(gate_up) and gate_up.dim() == 2:
        extension().silu_mul_(gate_up)
        return gate_up[:, :inter]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T -> [M, N], each output summed in one fixed order whatever M is
    (csrc/invariant_linear.cpp: bfloat16 by vdpbf16ps where the CPU has AVX512-BF16, float32 lanes
    otherwise), or None where the kernel does not run (model.tiled_linear then)."""
    if _on_kernel(x) and weight.dtype == x.dtype and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous():
        return extension().invariant_linear(x, weight)
    return None


if __name__ == "__main__":  # make install: build the kernels once for this machine
    extension()
    print(f"fused ops built for this CPU from {', '.join(source.name for source in SOURCES)}")
