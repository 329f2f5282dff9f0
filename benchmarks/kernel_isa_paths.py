"""The paged attention kernel built for each instruction set this CPU can run, side by side.

The kernel (engine/execution/attention/csrc/paged_attention.cpp) transposes each block's keys with
AVX-512 16 x 16 register transposes, AVX2 8 x 8 ones, or a plain loop, chosen at compile time by
``-march=native``. The suite only ever tests the path of the machine it runs on; this script builds
the other paths here too (``-mno-avx512f``, then also ``-mno-avx2``), checks that every build gives
the same bits on a grid of shapes (dtypes, head dims, block sizes, GQA ratios, decodes and a
prefill chunk, 5 and 40 sequences), and times a decode step of 32 sequences at 2,048 tokens on each (min of repeats).
Exits non-zero if two builds differ.

    python benchmarks/kernel_isa_paths.py [--repeats 10] [--build-only]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.execution.attention.cpu_paged import CFLAGS, SOURCE  # noqa: E402
from engine.execution.extensions import build_extension  # noqa: E402
from engine.execution.loader import cpu_flags  # noqa: E402

BUILDS = {"avx512": [], "avx2": ["-mno-avx512f"], "plain": ["-mno-avx512f", "-mno-avx2"]}
NEEDS = {"avx512": "avx512f", "avx2": "avx2"}  # the CPU flag without which a build is another's code


def build(name: str, flags: list[str]):
    return build_extension(f"pdserve_paged_attention_{name}", [SOURCE], CFLAGS + flags)


def case(dtype, head_dim: int, block_size: int, heads: tuple[int, int], seqs: int, context: int, decode_only: bool):
    """Random caches with the sequences' blocks scattered over the pool, and the kernel's arguments."""
    num_heads, num_kv_heads = heads
    blocks_per_seq = -(-context // block_size)
    num_blocks = seqs * blocks_per_seq + 3
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim).to(dtype)  # [S, Hkv, D]
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim).to(dtype)
    tables = torch.randperm(num_blocks)[: seqs * blocks_per_seq].int().reshape(seqs, blocks_per_seq).contiguous()
    lengths = torch.ones(seqs, dtype=torch.int64)
    positions = torch.full((seqs,), context - 1, dtype=torch.int64)
    if not decode_only:  # the last sequence brings a chunk of 8 query positions, the others decode at mixed positions
        lengths[-1], positions[-1] = 8, context - 8
        positions[:-1] = torch.randint(0, context, (seqs - 1,))
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    q = torch.randn(int(lengths.sum()), num_heads, head_dim).to(dtype)  # [N, Hq, D]
    return q, k_cache, v_cache, tables, rows, positions, lengths, block_size


def attend(kernel, args) -> torch.Tensor:
    q, k_cache, v_cache, tables, rows, positions, lengths, block_size = args
    out = torch.zeros_like(q)
    kernel.paged_attention(out, q, k_cache, v_cache, tables, rows, positions, lengths, block_size, 0,
                           q.shape[-1] ** -0.5)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--build-only", action="store_true",
                        help="only build the ones the suite loads, into torch's extension cache (make test)")
    args = parser.parse_args()
    runs = cpu_flags()
    names = [name for name in BUILDS if NEEDS.get(name, "") in runs | {""}]
    if args.build_only:  # the first is this CPU's own code, which the suite loads as cpu_paged's build
        for name in names[1:]:
            build(name, BUILDS[name])
        print(f"built for this CPU's tests: {', '.join(names[1:]) or 'none'} (its own, {names[0]}, is cpu_paged's)")
        return 0
    kernels = {name: build(name, BUILDS[name]) for name in names}
    print(f"builds for this CPU: {', '.join(kernels)} (a build whose instruction set it lacks is left out)")
    reference = next(iter(kernels))
    torch.manual_seed(0)
    grid = list(itertools.product((torch.float32, torch.bfloat16, torch.float16), (64, 128, 40, 24), (16, 8),
                                  ((9, 3), (4, 4), (8, 1))))
    differing = []
    for (dtype, head_dim, block_size, heads), seqs in itertools.product(grid, (5, 40)):  # tasks of one kv head, of all
        inputs = case(dtype, head_dim, block_size, heads, seqs=seqs, context=100, decode_only=False)
        outs = {name: attend(kernel, inputs) for name, kernel in kernels.items()}
        differing += [(name, dtype, head_dim, block_size, heads, seqs) for name, out in outs.items()
                      if not torch.equal(out, outs[reference])]
    print(f"{2 * len(grid)} shape cases, builds {', '.join(kernels)}: "
          + ("the same bits" if not differing else f"DIFFERENT bits in {differing}"))
    for dtype in (torch.float32, torch.bfloat16):
        inputs = case(dtype, 64, 16, (9, 3), seqs=32, context=2048, decode_only=True)
        times = {name: [] for name in kernels}
        for _ in range(args.repeats):  # interleaved, so that a change of load hits every build alike
            for name, kernel in kernels.items():
                start = time.perf_counter()
                attend(kernel, inputs)
                times[name].append(time.perf_counter() - start)
        print(f"decode 32 x 2,048, {str(dtype).removeprefix('torch.')}, ms per layer (min of {args.repeats}): "
              + ", ".join(f"{name} {min(t) * 1e3:.1f}" for name, t in times.items()))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
