"""The quantized kernels (csrc/quant_linear.cpp, csrc/quant_gemv.cpp), compiled for this machine's CPU (-march=native) on
first use or by ``python -m engine.execution.quant.kernels`` and kept (engine/execution/extensions.py).

Types with a kernel, by GGML number: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; of them Q4_0, Q4_1 and Q8_0 also
have the integer matrix-vector kernel. ``build(flags)`` builds the same sources with other flags (``-mno-avx512f``: the AVX2 path; also ``-mno-avx2``: plain code),
which tests/test_quant_linear.py compares bit for bit with the native build.
"""

from __future__ import annotations

from functools import cache
import logging
from pathlib import Path

from gguf import GGMLQuantizationType

from engine.execution.extensions import build_extension

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("quant_linear.cpp", "quant_gemv.cpp")]
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
KERNEL_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                          GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
# Types whose rows quant_gemv multiplies in integer arithmetic (one activation row quantized to int8).
INTEGER_GEMV_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"], "plain": ["-mno-avx512f", "-mno-avx2"]}


@cache
def build(isa: str = "native"):
    """The kernels compiled with ``ISA_FLAGS[isa]`` added (a minute on 2 cores the first time)."""
    suffix = "" if isa == "native" else f"_{isa}"
    return build_extension(f"pdserve_quant_linear{suffix}", SOURCES, CFLAGS + ISA_FLAGS[isa])


@cache
def available() -> bool:
    """Whether the native kernels build and load here; if not, GGUF weights are dequantized at load."""
    try:
        build()
    except Exception as error:  # a missing compiler, an unsupported platform
        log.warning("quantized linear: the C++ kernels are unavailable (%s); GGUF weights are dequantized", error)
        return False
    return True


if __name__ == "__main__":  # make install: build the kernels once for this machine
    build()
    print(f"quantized linear kernels built for this CPU from {', '.join(source.name for source in SOURCES)}")
