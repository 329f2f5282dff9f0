"""What batch-invariant mode costs in process: the engine with ``batch_invariant`` off and on, the
same model, prompts and attention backend (auto), interleaved round by round so that a burst of
load hits both alike; the best round of each. Two workloads, as issue 40 measures them: short
prompts (32 x 128 -> 64) and long ones (16 x 1,536 -> 64), greedy, EOS ignored, a random model
shaped like SmolLM-135M cut to 8 layers (benchmarks/engine_throughput.py).

    python benchmarks/invariance_cost.py [--dtype float32|bfloat16] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

from pathlib import Path
import sys
import tempfile

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import Workload, make_model, prompts, time_engine  # noqa: E402
from engine.execution.loader import cpu_flags  # noqa: E402

WORKLOADS = {"short": (32, 128, 64), "long": (16, 1536, 64)}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    result = {"dtype": args.dtype, "torch_threads": torch.get_num_threads(),
              "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp))
        for name in args.workloads:
            w = Workload(*WORKLOADS[name], dtype=args.dtype)
            ids = prompts(w)
            best = {False: 0.0, True: 0.0}
            for _ in range(args.rounds):
                for invariant in (False, True):
                    rate = w.num_prompts * w.output_len / time_engine(model_dir, ids, w, batch_invariant=invariant)
                    best[invariant] = max(best[invariant], rate)
                    print(f"{name}: invariant {'on ' if invariant else 'off'} {rate:8.1f} tok/s", flush=True)
            result[name] = {"workload": f"{w.num_prompts} x {w.input_len} -> {w.output_len}",
                            "off_tok_s": best[False], "on_tok_s": best[True], "cost": 1 - best[True] / best[False]}
            print(f"{name}: off {best[False]:.1f}, on {best[True]:.1f} tok/s: invariance costs "
                  f"{result[name]['cost']:.1%}", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
