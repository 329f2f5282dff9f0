"""One layer's attention per backend (engine/execution/attention/), back to back in one run.

Shapes of SmolLM-135M (9 query heads, 3 KV heads, head dim 64), blocks of 16 tokens scattered
over the pool as a long-running server leaves them. Backends: torch_sdpa (the reference),
cpu_paged as the default mode runs it (decodes on the kernel, prefill chunks on flash SDPA) and
cpu_paged_all (every row on the kernel: batch-invariant mode). Cases: a decode step of ``--seqs`` sequences
at ``--context`` tokens each, and a prefill of one ``--context``-token prompt in one chunk and in
chunks of 256 (each chunk attending to everything before it).

    python benchmarks/attention.py [--dtype float32|bfloat16] [--seqs 32] [--context 2048] [--json PATH]
"""

from __future__ import annotations

from pathlib import Path
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from engine.execution.attention import AttentionSeq, cpu_paged, torch_sdpa  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CPU = torch.device("cpu")


def scattered_step(specs: list[tuple[int, int]], num_blocks: int,
                   block_size: int = BLOCK) -> tuple[list[AttentionSeq], torch.Tensor]:
    """Sequences (start, new tokens) with their blocks drawn at random from the pool, and the
    slots [N] of their new tokens."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    seqs, slots, flat = [], [], 0
    for start, n in specs:
        table = [free.pop() for _ in range(-(-(start + n) // block_size))]
        seqs.append(AttentionSeq(flat, n, start, table))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        flat += n
    return seqs, torch.tensor(slots)


def seconds_per_call(backend, steps: list[list[tuple[int, int]]], dtype: torch.dtype, repeats: int) -> float:
    """The mean time of one layer's attention over ``steps`` (each a list of (start, tokens)), with
    the step's metadata built once as the engine does; the best of ``repeats``."""
    num_blocks = sum(-(-(s + n) // BLOCK) for step in steps for s, n in step) + 8
    k_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    prepared = []
    for step in steps:
        seqs, slots = scattered_step(step, num_blocks)
        n = len(slots)
        q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
        prepared.append((backend.prepare(slots, seqs, {None}, BLOCK, CPU), q, k, v))
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        for meta, q, k, v in prepared:
            meta.attend(q, k, v, k_cache, v_cache, None)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    ctx = args.context
    cases = {
        f"decode {args.seqs} x {ctx}": [[(ctx - 1, 1)] * args.seqs],
        f"prefill {ctx} whole": [[(0, ctx)]],
        f"prefill {ctx} in chunks of 256": [[(start, 256)] for start in range(0, ctx, 256)],
    }
    backends = {"torch_sdpa": torch_sdpa.BACKEND, "cpu_paged": cpu_paged.backend(),
                "cpu_paged_all": cpu_paged.backend(all_rows=True)}  # all rows: batch-invariant mode
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(), "ms": {}}
    print(f"{args.dtype}, {torch.get_num_threads()} threads; ms per layer")
    print(f"{'case':<34}" + "".join(f"{name:>15}" for name in backends) + f"{'sdpa / paged':>14}")
    for case, steps in cases.items():
        ms = {name: 1e3 * seconds_per_call(b, steps, dtype, args.repeats) for name, b in backends.items()}
        result["ms"][case] = ms
        print(f"{case:<34}" + "".join(f"{v:>15.2f}" for v in ms.values())
              + f"{ms['torch_sdpa'] / ms['cpu_paged']:>13.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
