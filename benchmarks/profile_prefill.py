"""Where a long prefill's time goes: the engine in-process under torch.profiler, ops by self CPU time.

Default workload: 16 prompts x 1,536 tokens in, 4 out, on the random SmolLM-135M-shaped model
cut to 8 layers (benchmarks/engine_throughput.py builds it), in the given dtype (bfloat16 only
where the CPU computes it natively: avx512_bf16 or amx). One unprofiled warm-up run first.
Prints each op's share of the profiled run's self CPU time, then the shares of three groups:
GEMMs (aten::mm/addmm/linear, oneDNN's and the batch-invariant kernel), attention, and the rest.
The project's C++ kernels are named in the profile (``pdserve::`` and the kernel's name): each call
goes through a ``record_function`` here, since torch's profiler does not see pybind calls.

    python benchmarks/profile_prefill.py [--dtype float32|bfloat16] [--num-prompts 16] [--input-len 1536]
        [--batch-invariant]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import Workload, make_model, prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.execution import fused_ops  # noqa: E402
from engine.execution.attention import cpu_paged  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "mkldnn::", "aten::mkldnn", "onednn",
            "pdserve::invariant_linear")
ATTENTION_OPS = ("flash_attention", "paged_attention", "scaled_dot_product")


def name_the_kernels() -> None:
    """Each function of the C++ extensions called through a ``record_function("pdserve::<name>")``."""
    for module in (fused_ops.extension(), cpu_paged.extension()):
        for name in [n for n in dir(module) if not n.startswith("_")]:
            kernel = getattr(module, name)

            def named(*args, _kernel=kernel, _label=f"pdserve::{name}"):
                with record_function(_label):
                    return _kernel(*args)
            setattr(module, name, named)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=1536)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--batch-invariant", action="store_true", help="the engine in batch-invariant mode")
    args = parser.parse_args()
    w = Workload(args.num_prompts, args.input_len, args.output_len, args.dtype)
    ids = prompts(w)
    params = SamplingParams(max_new_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(EngineConfig(model=str(make_model(Path(tmp))), dtype=w.dtype, kv_cache_memory_gb=1.0,
                                        batch_invariant=args.batch_invariant, enable_prefix_caching=False))
        name_the_kernels()
        engine.generate([GenerationRequest(f"w{i}", p, params) for i, p in enumerate(ids[:2])])  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(ids)])
            seconds = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{w.num_prompts} x {w.input_len} -> {w.output_len}, {w.dtype}, {torch.get_num_threads()} threads: "
          f"{seconds:.2f} s wall, {total / 1e6:.2f} s self CPU, batch invariance {'on' if args.batch_invariant else 'off'}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        print(f"  {e.key:<60}{e.self_cpu_time_total / total:>7.1%}{e.count:>8}")
    gemm = sum(e.self_cpu_time_total for e in events if any(g in e.key for g in GEMM_OPS))
    attention = sum(e.self_cpu_time_total for e in events if any(a in e.key for a in ATTENTION_OPS))
    print(f"GEMMs {gemm / total:.1%}, attention {attention / total:.1%}, the rest {1 - (gemm + attention) / total:.1%}")


if __name__ == "__main__":
    main()
