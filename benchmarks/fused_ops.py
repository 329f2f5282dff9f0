"""The fused elementwise ops three ways, interleaved in one run: the torch reference (eager), the
C++ kernel (engine/execution/fused_ops.py), and torch.compile of the reference (dynamic shapes,
compiled once; its compile time is printed, since an engine would pay it at start-up).

Shapes of SmolLM-135M (hidden 576, 9 + 3 heads of 64, intermediate 1,536) at a prefill chunk's
rows (2,048) and a decode step's (32). Best of ``--repeats`` rounds, each op timed back to back.

    python benchmarks/fused_ops.py [--dtype float32|bfloat16] [--no-compile]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.execution.fused_ops import add_rms_norm, rms_norm_reference, rope, rope_reference, silu_mul  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


def reference_add_rms_norm(x, delta, weight):
    x = x + delta
    return x, rms_norm_reference(x, weight, 1e-5)


def reference_rope(q, k, cos, sin):
    return rope_reference(q, cos, sin), rope_reference(k, cos, sin)


def reference_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def inputs(rows: int, dtype: torch.dtype) -> dict[str, tuple]:
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q = qkv[:, : HEADS * HEAD_DIM].unflatten(1, (HEADS, HEAD_DIM))
    k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].unflatten(1, (KV_HEADS, HEAD_DIM))
    return {"add_rms_norm": (torch.randn(rows, HIDDEN, dtype=dtype), torch.randn(rows, HIDDEN, dtype=dtype),
                             torch.randn(HIDDEN, dtype=dtype)),
            "rope": (q, k, torch.randn(rows, HEAD_DIM, dtype=dtype), torch.randn(rows, HEAD_DIM, dtype=dtype)),
            "silu_mul": (torch.randn(rows, 2 * INTER, dtype=dtype),)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    references = {"add_rms_norm": reference_add_rms_norm, "rope": reference_rope, "silu_mul": reference_silu_mul}
    kernels = {"add_rms_norm": lambda x, d, w: add_rms_norm(x, d, w, 1e-5), "rope": rope, "silu_mul": silu_mul}
    compiled, compile_s = {}, {}
    if not args.no_compile:
        for name, fn in references.items():
            compiled[name] = torch.compile(fn, dynamic=True)
            start = time.perf_counter()
            compiled[name](*inputs(37, dtype)[name])
            compile_s[name] = time.perf_counter() - start
    print(f"{args.dtype}, {torch.get_num_threads()} threads; ms per call, best of {args.repeats}")
    print(f"{'op':<14}{'rows':>6}{'reference':>11}{'kernel':>9}{'compiled':>10}{'compile s':>11}")
    for rows in (2048, 32):
        data = inputs(rows, dtype)
        for name in references:
            ways = {"reference": references[name], "kernel": kernels[name], **({"compiled": compiled[name]}
                                                                              if compiled else {})}
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(args.repeats):  # interleaved: a burst of load hits every way alike
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn(*data[name])
                    best[way] = min(best[way], time.perf_counter() - start)
            cells = "".join(f"{best[w] * 1e3:>{width}.3f}" for w, width in (("reference", 11), ("kernel", 9)))
            cells += f"{best['compiled'] * 1e3:>10.3f}{compile_s[name]:>11.1f}" if compiled else ""
            print(f"{name:<14}{rows:>6}{cells}")


if __name__ == "__main__":
    main()
