"""Engine throughput against transformers and vLLM's CPU backend, with the machine's floors beside it.

One run, one machine, one workload: (a) transformers ``generate`` with one static batch,
(b) transformers' continuous-batching ``generate_batch``, (c) pdserve's engine, (d) vLLM's
CPU backend when its venv exists (``make bench-vllm`` builds .venv-vllm), on the same model
directory and prompts, run back to back; (e) the matmul-chain floor: the model's own linear
layers chained at the same batch shapes as the engine's steps (prefill chunks, then one decode
step per output token), nothing else. Default workload: 32 prompts x 128 tokens in, 64 out,
EOS ignored, greedy, a random model shaped like SmolLM-135M cut to 8 layers. ``--fused-references``
also times the engine with its fused elementwise ops as torch references (the before of
engine/execution/fused_ops.py), interleaved with the kernels, best of two each. The floors (matmul
rate, roofline, matmul chain) are measured in the run's own dtype. ``--modes`` also runs the
engine on each attention backend and in batch-invariant mode, back to back.

    python benchmarks/engine_throughput.py [--dtype float32|bfloat16] [--json PATH] [--device cpu|cuda] [--modes]
        [--fused-references] [--engine-only]

``--engine-only`` times the engine alone (no transformers, vLLM or matmul chain): the short run for
before/after pairs of engine changes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import json
import os
from pathlib import Path
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.machine import copy_bandwidth, matmul_flops  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.execution import fused_ops  # noqa: E402
from engine.execution.loader import cpu_flags  # noqa: E402
from engine.execution.model import linear  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from engine.execution.tiny_model import ensure_tiny_model  # noqa: E402
from sampling import SamplingParams  # noqa: E402

# SmolLM-135M's shape, 8 of its 30 layers.
SMOLLM_8L = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                 tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


@dataclass
class Workload:
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    dtype: str = "float32"
    device: str = "cpu"


def make_model(directory: Path, **config_overrides) -> Path:
    """The random SmolLM-8L model (with ``config_overrides`` on its config) and tiny-llama's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMOLLM_8L, **config_overrides})).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny_model() / name, directory / name)
    return directory


def roofline_tokens_per_s(w: Workload, flops_per_s: float, bytes_per_s: float) -> tuple[float, dict]:
    """Generated tokens/s if every phase ran at the machine's matmul rate or copy bandwidth,
    whichever binds: prefill (prompt tokens through the layers, the LM head on the last
    token) then one decode step per output token (all rows through layers and LM head)."""
    c = SMOLLM_8L
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter
    element = torch.empty((), dtype=getattr(torch, w.dtype)).element_size()
    weight_bytes = (layers * layer_params + vocab * h) * element
    b, t = w.num_prompts, w.input_len
    attn_prefill = layers * 2 * 2 * b * (t * (t + 1) / 2) * q  # QK^T and PV, causal
    prefill_flops = 2 * b * t * layers * layer_params + attn_prefill + 2 * b * h * vocab
    seconds = max(prefill_flops / flops_per_s, weight_bytes / bytes_per_s)
    for step in range(1, w.output_len):
        ctx = t + step
        flops = 2 * b * (layers * layer_params + h * vocab) + layers * 2 * 2 * b * ctx * q
        kv_bytes = layers * 2 * b * ctx * kv * element
        seconds += max(flops / flops_per_s, (weight_bytes + kv_bytes) / bytes_per_s)
    return b * w.output_len / seconds, {"prefill_gflop": prefill_flops / 1e9, "weight_mb": weight_bytes / 1e6}


def prompts(w: Workload) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, SMOLLM_8L["vocab_size"], (w.input_len,), generator=generator).tolist()
            for _ in range(w.num_prompts)]


def time_hf_generate(model, ids: list[list[int]], w: Workload) -> float:
    batch = torch.tensor(ids, device=w.device)
    start = time.perf_counter()
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                         max_new_tokens=w.output_len, min_new_tokens=w.output_len, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape == (w.num_prompts, w.input_len + w.output_len)
    return elapsed


def time_hf_generate_batch(model, ids: list[list[int]], w: Workload) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=w.output_len, min_new_tokens=w.output_len, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    results = model.generate_batch(inputs=ids, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    assert all(len(r.generated_tokens) == w.output_len for r in results.values())
    return elapsed


def time_matmul_chain(w: Workload, chunk: int = 2048) -> float:
    """The floor: the model's linear layers (and LM head for the sampling rows) at the engine's
    step shapes: prefill in chunks of ``chunk`` tokens, then output_len - 1 decode steps of
    num_prompts rows. Weights random, in the workload's dtype, through the engine's ``linear``."""
    c, dtype, device = SMOLLM_8L, getattr(torch, w.dtype), w.device
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    weight = lambda o, i: torch.randn(o, i, dtype=dtype, device=device) * 0.02  # noqa: E731
    layers = [(weight(q + 2 * kv, h), weight(h, q), weight(2 * inter, h), weight(h, inter))
              for _ in range(c["num_hidden_layers"])]
    head = weight(vocab, h)

    def step(rows: int, sampled: int) -> None:
        # Inputs of the right shape for each matmul: attention and the MLP's activation are not counted.
        x = torch.randn(rows, h, dtype=dtype, device=device)
        attention_out = torch.randn(rows, q, dtype=dtype, device=device)
        activation = torch.randn(rows, inter, dtype=dtype, device=device)
        for qkv, o, gate_up, down in layers:
            linear(x, qkv)
            linear(attention_out, o)
            linear(x, gate_up)
            x = linear(activation, down)
        linear(x[:sampled], head)

    total = w.num_prompts * w.input_len
    step(min(chunk, total), 1)  # warm-up
    start = time.perf_counter()
    for first in range(0, total, chunk):
        rows = min(chunk, total - first)
        step(rows, rows // w.input_len)
    for _ in range(w.output_len - 1):
        step(w.num_prompts, w.num_prompts)
    return time.perf_counter() - start


def time_vllm(model_dir: Path, ids: list[list[int]], w: Workload, venv: Path) -> float | None:
    """vLLM CPU on the same model directory and prompts, in its own venv; None when absent."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    work = model_dir / "vllm_workload.json"
    work.write_text(json.dumps({"model": str(model_dir), "dtype": w.dtype, "prompts": ids,
                                "output_len": w.output_len, "max_num_seqs": 256}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                      f"0-{torch.get_num_threads() - 1}")}
    run = subprocess.run([str(python), str(Path(__file__).with_name("vllm_offline.py")), str(work)], env=env,
                         capture_output=True, text=True, timeout=1800)
    if run.returncode != 0 or "RESULT " not in run.stdout:
        print(f"vLLM failed (exit {run.returncode}):\n{run.stderr[-3000:]}", file=sys.stderr)
        return None
    result = json.loads([line for line in run.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert result["generated"] == w.num_prompts * w.output_len
    return result["seconds"]


# --modes: the engine's attention backends and its batch-invariant mode (EngineConfig fields).
ENGINE_MODES = {"torch_sdpa": dict(attention_backend="torch_sdpa", batch_invariant=False),
                "cpu_paged": dict(attention_backend="cpu_paged", batch_invariant=False),
                "cpu_paged_invariant": dict(attention_backend="cpu_paged", batch_invariant=True)}


def time_engine(model_dir: Path, ids: list[list[int]], w: Workload, fused_kernels: bool = True, **config) -> float:
    """``config``: EngineConfig fields beside the workload's (default: auto backend, invariance off);
    ``fused_kernels`` False: the decoder's elementwise ops as their torch references (engine/execution/fused_ops.py)."""
    config = {"batch_invariant": False, **config}
    fused_ops.set_kernels_enabled(fused_kernels)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=w.dtype, device=w.device, kv_cache_memory_gb=1.0,
                                    **config))
    params = SamplingParams(max_new_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(ids)])
    elapsed = time.perf_counter() - start
    assert all(r.num_output_tokens == w.output_len for r in results.values())
    fused_ops.set_kernels_enabled(True)
    return elapsed


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-hf-batch", action="store_true", help="leave out generate_batch")
    parser.add_argument("--modes", action="store_true", help="also time each of " + ", ".join(ENGINE_MODES))
    parser.add_argument("--fused-references", action="store_true",
                        help="also time the engine with the torch references of its fused ops, interleaved with it")
    parser.add_argument("--engine-only", action="store_true",
                        help="time the engine alone: no transformers, vLLM or matmul chain (before/after pairs)")
    parser.add_argument("--vllm-venv", type=Path, default=Path(__file__).resolve().parents[1] / ".venv-vllm",
                        help="a venv with vllm-cpu (make bench-vllm); skipped when absent")
    args = parser.parse_args()
    w = Workload(args.num_prompts, args.input_len, args.output_len, args.dtype, args.device)
    from transformers import AutoModelForCausalLM

    flops, bandwidth = matmul_flops(getattr(torch, w.dtype)), copy_bandwidth()
    roofline, shape = roofline_tokens_per_s(w, flops, bandwidth)
    ids = prompts(w)
    generated = w.num_prompts * w.output_len
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp))
        if not args.engine_only:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, w.dtype)).to(w.device).eval()
            time_hf_generate(hf, [p[:16] for p in ids[:2]], Workload(2, 16, 2, w.dtype, w.device))  # warm-up
            rates["hf_generate_tok_s"] = generated / time_hf_generate(hf, ids, w)
            if not args.skip_hf_batch:
                rates["hf_generate_batch_tok_s"] = generated / time_hf_generate_batch(hf, ids, w)
            del hf
        rates["engine_tok_s"] = generated / time_engine(model_dir, ids, w)
        if args.fused_references:  # before/after, interleaved: a burst of load hits both alike
            for way in ("engine_fused_references_tok_s", "engine_tok_s", "engine_fused_references_tok_s"):
                rate = generated / time_engine(model_dir, ids, w, fused_kernels=way == "engine_tok_s")
                rates[way] = max(rates.get(way, 0.0), rate)
        if args.modes:
            for name, config in ENGINE_MODES.items():
                rates[f"engine_{name}_tok_s"] = generated / time_engine(model_dir, ids, w, **config)
        with_vllm = w.device == "cpu" and not args.engine_only
        vllm_seconds = time_vllm(model_dir, ids, w, args.vllm_venv) if with_vllm else None
        if vllm_seconds is not None:
            rates["vllm_cpu_tok_s"] = generated / vllm_seconds
        if not args.engine_only:
            rates["matmul_chain_tok_s"] = generated / time_matmul_chain(w)
    engine = rates["engine_tok_s"]
    best_hf = max((v for k, v in rates.items() if k.startswith("hf_")), default=None)
    result = {**rates, "roofline_tok_s": roofline, "engine_vs_best_hf": engine / best_hf if best_hf else None,
              "engine_vs_roofline": engine / roofline,
              "engine_vs_matmul_chain": engine / rates["matmul_chain_tok_s"] if "matmul_chain_tok_s" in rates else None,
              "engine_vs_vllm": engine / rates["vllm_cpu_tok_s"] if vllm_seconds else None,
              "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
              "matmul_gflop_s": flops / 1e9,
              "copy_gb_s": bandwidth / 1e9, "torch_threads": torch.get_num_threads(),
              "workload": {**asdict(w), **shape, "model": "SmolLM-135M shape, 8 layers, random"}}
    print(f"machine: {w.dtype} matmul {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads")
    print(f"workload: {w.num_prompts} prompts x {w.input_len} in, {w.output_len} out, {w.dtype}, {w.device}")
    print(f"{'system':<28}{'tok/s':>10}{'vs engine':>12}")
    for name in ("hf_generate_tok_s", "hf_generate_batch_tok_s", "vllm_cpu_tok_s", "engine_tok_s",
                 "engine_fused_references_tok_s",
                 *(f"engine_{mode}_tok_s" for mode in ENGINE_MODES), "matmul_chain_tok_s", "roofline_tok_s"):
        value = result.get(name)
        if value is not None:
            print(f"{name:<28}{value:>10.1f}{value / rates['engine_tok_s']:>12.2f}")
    if best_hf:
        print(f"engine / best HF = {result['engine_vs_best_hf']:.2f}x, engine / matmul chain = "
              f"{result['engine_vs_matmul_chain']:.0%}")
    print(f"engine / roofline = {result['engine_vs_roofline']:.0%}")
    if result["engine_vs_vllm"] is not None:
        print(f"engine / vLLM CPU = {result['engine_vs_vllm']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
