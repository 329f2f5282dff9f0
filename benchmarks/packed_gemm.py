"""Prepacked GEMMs and the batch-invariant GEMM against the engine's ``linear`` (aten::mm) at the
shapes of SmolLM-135M's maps.

float32: MKL's packed sgemm (``torch.ops.mkl._mkl_reorder_linear_weight`` once, then
``_mkl_linear``: what torch.compile's CPU freezing emits for float32). bfloat16: oneDNN's packed
linear (``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``), which torch
runs only on CPUs with avx512bw/vl/dq or avx_ne_convert; elsewhere the row says so. Beside them
the GEMM of batch-invariant mode (``fused_ops.invariant_linear``, csrc/invariant_linear.cpp) and its
torch reference, ``tiled_linear`` (calls of 32 rows). Decode (1, 7, 32 rows) and prefill (256,
2,048) sizes, interleaved, best of ``--repeats``; GFLOP/s.

    python benchmarks/packed_gemm.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.execution.model import linear, tiled_linear  # noqa: E402

# (out, in) of the fused q/k/v, o, gate/up, down maps and the LM head
MAPS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def packed(weight: torch.Tensor, rows: int):
    """A function x -> x @ weight^T on the weight packed once for ``rows``-row calls, or the reason there is none."""
    try:
        if weight.dtype == torch.float32:
            pack = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            return lambda x: torch.ops.mkl._mkl_linear(x, pack, weight, None, rows)
        pack = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, pack, None, "none", [], "")
    except RuntimeError as error:
        return str(error).splitlines()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {torch.get_num_threads()} threads; GFLOP/s, best of {args.repeats}")
    print(f"{'map':<9}{'rows':>6}{'aten::mm':>10}{'packed':>9}{'invariant':>11}{'tiled32':>9}  packed == mm")
    for name, (out, inner) in MAPS.items():
        weight = torch.randn(out, inner, dtype=dtype) * 0.02
        for rows in (1, 7, 32, 256, 2048):
            x = torch.randn(rows, inner, dtype=dtype)
            ways = {"mm": lambda x=x: linear(x, weight), "packed": packed(weight, rows),
                    "invariant": lambda x=x: linear(x, weight, invariant=True),
                    "tiled32": lambda x=x: tiled_linear(x, weight, None)}
            unavailable = ways.pop("packed") if isinstance(ways["packed"], str) else None
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(args.repeats):
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn(x)
                    best[way] = min(best[way], time.perf_counter() - start)
            rate = {way: f"{2 * rows * out * inner / seconds / 1e9:.1f}" for way, seconds in best.items()}
            equal = "-" if unavailable else str(torch.equal(ways["packed"](x), linear(x, weight)))
            print(f"{name:<9}{rows:>6}{rate['mm']:>10}{rate.get('packed', '-'):>9}{rate['invariant']:>11}"
                  f"{rate['tiled32']:>9}  {equal}")
        if unavailable:
            print(f"  packed unavailable: {unavailable}")


if __name__ == "__main__":
    main()
