"""What batch-invariant mode costs in process: the engine with ``batch_invariant`` off and on, the
same model, prompts and attention backend (auto), interleaved round by round so that a burst of
load hits both alike; the best round of each. Workloads, greedy, EOS ignored: as issue 40 measures
them, short prompts (``short``: 32 x 128 -> 64) and long ones (``long``: 16 x 1,536 -> 64); by
streams, as issue 57 does (``1``: 1 x 128 -> 128, ``32``: 32 x 128 -> 64, ``256``: 256 x 32 -> 32).
The model: a random one shaped like SmolLM-135M cut to 8 layers (benchmarks/engine_throughput.py),
or ``--model`` (a model directory or a GGUF file, e.g. the shipped
models/SmolLM2-135M-Instruct.Q4_1.gguf, its weights kept quantized). ``--gemm`` also times the
batch-invariant GEMM alone against aten::mm at SmolLM-135M's maps, in the run's dtype (best of 20).

    python benchmarks/invariance_cost.py [--dtype float32|bfloat16] [--rounds 2] [--workloads 1 32 256]
        [--model PATH] [--gemm] [--json PATH]
"""

from __future__ import annotations

from pathlib import Path
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import Workload, make_model, prompts, time_engine  # noqa: E402
from benchmarks.packed_gemm import MAPS  # noqa: E402
from engine.execution import fused_ops  # noqa: E402
from engine.execution.loader import cpu_flags  # noqa: E402

WORKLOADS = {"short": (32, 128, 64), "long": (16, 1536, 64),
             "1": (1, 128, 128), "32": (32, 128, 64), "256": (256, 32, 32)}
GEMM_ROWS = (1, 32, 256, 2048)


def gemm_alone(dtype: torch.dtype) -> dict:
    """GFLOP/s of aten::mm and of the invariant GEMM per map and rows, interleaved, best of 20."""
    result = {}
    for name, (out, inner) in MAPS.items():
        weight = torch.randn(out, inner, dtype=dtype) * 0.02
        for rows in GEMM_ROWS:
            x = torch.randn(rows, inner, dtype=dtype)
            ways = {"mm": lambda: torch.mm(x, weight.t()), "invariant": lambda: fused_ops.invariant_linear(x, weight)}
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(20):
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    best[way] = min(best[way], time.perf_counter() - start)
            rate = {way: 2 * rows * out * inner / seconds / 1e9 for way, seconds in best.items()}
            result[f"{name} {rows}"] = {**rate, "invariant_time_over_mm": best["invariant"] / best["mm"]}
            print(f"gemm {name:<8}{rows:>5} rows: mm {rate['mm']:7.1f}, invariant {rate['invariant']:7.1f} GFLOP/s "
                  f"(time {best['invariant'] / best['mm']:.2f}x mm's)", flush=True)
    return result


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["short", "long"], choices=list(WORKLOADS))
    parser.add_argument("--model", type=Path, help="a model directory or GGUF file (default: random SmolLM-8L)")
    parser.add_argument("--gemm", action="store_true", help="also time the invariant GEMM alone against aten::mm")
    args = parser.parse_args()
    result = {"dtype": args.dtype, "torch_threads": torch.get_num_threads(), "model": str(args.model or "SmolLM-8L"),
              "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
              "bf16_dot_gemm": bool(fused_ops.extension().invariant_linear_bf16_dot())}
    if args.gemm:
        result["gemm"] = gemm_alone(getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp))
        for name in args.workloads:
            w = Workload(*WORKLOADS[name], dtype=args.dtype)
            ids = prompts(w)
            best = {False: 0.0, True: 0.0}
            for _ in range(args.rounds):
                for invariant in (False, True):
                    rate = w.num_prompts * w.output_len / time_engine(model, ids, w, batch_invariant=invariant)
                    best[invariant] = max(best[invariant], rate)
                    print(f"{name}: invariant {'on ' if invariant else 'off'} {rate:8.1f} tok/s", flush=True)
            result[name] = {"workload": f"{w.num_prompts} x {w.input_len} -> {w.output_len}",
                            "off_tok_s": best[False], "on_tok_s": best[True], "cost": 1 - best[True] / best[False]}
            print(f"{name}: off {best[False]:.1f}, on {best[True]:.1f} tok/s: invariance costs "
                  f"{result[name]['cost']:.1%}", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
