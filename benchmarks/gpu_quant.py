"""The Triton kernels of GGUF's quantized types (engine/execution/quant/triton_linear.py) on one CUDA
GPU, against the dequantized weight they replace, in one run (about a minute on an H100/H200; the
interpreter is not timed: without a GPU the script stops at once).

Per type (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), per map (SmolLM2-135M's qkv, gate/up, down and tied LM
head; a 1B Llama's qkv, gate/up, down) and per row count M (1: a stream's decode step; 16, 128:
batched decode; 1024: a prefill chunk):

- the kernel's time (CUDA events, median of triton.testing.do_bench) and the weight bytes it reads
  per second (the stored blocks once per call);
- the same product as served before issue 57: torch's bfloat16 GEMM over the dequantized weight,
  and the ratio kernel / GEMM (below 1: the stored weight is faster);
- a check on each: the kernel's bfloat16 result against the GEMM's, within bfloat16's rounding.

    python benchmarks/gpu_quant.py [--json PATH] [--types Q4_1,Q8_0] [--rows 1,16,128,1024]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import sys

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.execution.quant import reference, triton_linear  # noqa: E402
from tests.test_quant_linear import blocks  # noqa: E402  (random blocks of each type, small finite scales)

# (name, N, K): SmolLM2-135M (hidden 576, 3 KV heads of 64, intermediate 1536, vocab 49,152) and a 1B
# Llama (hidden 2048, 8 KV heads of 64, intermediate 8192). K-quants need K in whole 256s: the 576-wide
# maps of SmolLM2 are stored in 32-blocks by llama.cpp too, so they are timed for the 32-block types only.
MAPS = [("smollm2.qkv", 960, 576), ("smollm2.gate_up", 3072, 576), ("smollm2.down", 576, 1536),
        ("smollm2.lm_head", 49152, 576), ("llama1b.qkv", 3072, 2048), ("llama1b.gate_up", 16384, 2048),
        ("llama1b.down", 2048, 8192)]
TYPES = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q4_K": Q.Q4_K, "Q6_K": Q.Q6_K}


def time_ms(function) -> float:
    return triton.testing.do_bench(function, warmup=25, rep=100, return_mode="median")


def one(quant_type: Q, n: int, k: int, m: int) -> dict:
    raw_cpu = blocks(quant_type, n, k)
    raw = raw_cpu.cuda()
    weight = reference.dequantize(raw_cpu, quant_type).to("cuda", torch.bfloat16)  # [N, K]: as served before
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda")
    kernel = time_ms(lambda: triton_linear.linear(x, raw, quant_type, out))
    gemm = time_ms(lambda: x @ weight.t())
    expected = (x @ weight.t()).float()
    error = ((out - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    return {"type": quant_type.name, "n": n, "k": k, "m": m, "kernel_ms": kernel, "bf16_gemm_ms": gemm,
            "ratio": kernel / gemm, "kernel_weight_gbps": raw.numel() / kernel / 1e6,
            "gemm_weight_gbps": weight.numel() * 2 / gemm / 1e6, "max_relative_error": error, "ok": error < 2e-2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rows", default="1,16,128,1024")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_quant.py times the Triton kernels on a CUDA GPU; none is here")
    rows = [int(m) for m in args.rows.split(",")]
    results = []
    print(f"{torch.cuda.get_device_name()}; ratio: the kernel's time / bf16 GEMM over the dequantized weight")
    print(f"{'type':5} {'map':16} {'M':>5} {'kernel ms':>10} {'GEMM ms':>9} {'ratio':>6} {'GB/s':>7} ok")
    for type_name in args.types.split(","):
        quant_type = TYPES[type_name]
        for name, n, k in MAPS:
            if k % GGML_QUANT_SIZES[quant_type][0]:
                continue
            for m in rows:
                result = one(quant_type, n, k, m) | {"map": name}
                results.append(result)
                print(f"{type_name:5} {name:16} {m:5} {result['kernel_ms']:10.4f} {result['bf16_gemm_ms']:9.4f} "
                      f"{result['ratio']:6.2f} {result['kernel_weight_gbps']:7.0f} {result['ok']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
