"""GGUF weights kept quantized against the dequantized model (issue 57), in process, one run:

- the box's read bandwidth: a float32 sum over a 512 MiB buffer (far past the last-level cache), best of 10;
- per mode (``dequantize``: every weight in the dtype, as before; ``stored``: the file's types where a
  kernel exists; ``stored-no-gemv``: the same without the integer matrix-vector kernel, so one row
  takes the multi-row kernel as before it), interleaved round by round, best round of each: the single-stream decode step
  (median over one 128 -> 128 greedy request's decode steps, EOS ignored), its prefill step and its
  tokens per second, and 32 x 128 -> 64 (greedy) in tokens per second;
- the fastest decode step beside the median: the box is shared, and the fastest step is the least disturbed;
- the resident weight bytes against the file's size, and the step against (weight bytes read per
  token / read bandwidth): every weight is read once per decode step (the tied table as the LM head);
- where the stored modes' decode step goes (``--breakdown``): the medians over 60 steps of the layers'
  quantized maps by kind, the LM head, the rest of the model's forward (attention, norms, RoPE, the
  Python between them) and the engine outside the model (inputs, sampling, outputs).

    python benchmarks/quant_decode.py [--model PATH.gguf] [--dtype bfloat16] [--rounds 2] [--threads 2] [--breakdown]
                                      [--json PATH]
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
import statistics
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.execution.model import DecoderModel  # noqa: E402
from engine.execution.quant.linear import QuantizedLinear  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODES = {"dequantize": "dequantize", "stored-no-gemv": None, "stored": None}  # name -> EngineConfig.quantization


def read_bandwidth(mib: int = 512, repeats: int = 10) -> float:
    """Bytes per second a float32 sum reads over ``mib`` MiB (best of ``repeats``)."""
    buffer = torch.ones(mib * 2**20 // 4)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def single_stream(engine: LLMEngine, first_token: int = 100, input_len: int = 128,
                  output_len: int = 128) -> tuple[float, float, float, float]:
    """(median decode step, fastest decode step, the prefill step in seconds, tokens per second over
    the whole request) for one greedy request, its prompt ``first_token``, ``first_token`` + 1, ...
    (a new first token per call: no prefix-cache hit). The fastest step is the least disturbed by
    other load on the box."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest("single", list(range(first_token, first_token + input_len)), params))
    steps = []
    start = time.perf_counter()
    while engine.has_work():
        step_start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    return statistics.median(steps[1:]), min(steps[1:]), steps[0], output_len / elapsed  # steps[0]: the prefill


def batch(engine: LLMEngine, num: int = 32, input_len: int = 128, output_len: int = 64) -> float:
    """Tokens per second for ``num`` greedy requests of ``input_len`` -> ``output_len`` at once."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [GenerationRequest(f"b{i}", [100 + (i * 7 + j) % 5000 for j in range(input_len)], params)
                for i in range(num)]
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    assert all(r.num_output_tokens == output_len for r in results.values())
    return num * output_len / elapsed


def step_breakdown(engine: LLMEngine, steps: int = 60) -> dict[str, float]:
    """Median milliseconds per decode step of one stream, by part (timers around the model's modules)."""
    model = engine.loaded.model
    kinds = {id(module): "lm_head" if name in ("lm_head", "embed_tokens.table") else name.rsplit(".", 1)[-1]
             for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    spent: dict[str, float] = defaultdict(float)
    originals = [(QuantizedLinear, "forward", lambda module: kinds[id(module)]),
                 (DecoderModel, "forward", lambda module: "model forward"),
                 (DecoderModel, "compute_logits", lambda module: "compute_logits")]

    def timed(function, kind):
        def wrapper(module, *args, **kwargs):
            start = time.perf_counter()
            result = function(module, *args, **kwargs)
            spent[kind(module)] += time.perf_counter() - start
            return result
        return wrapper

    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in originals]
    for cls, name, kind in originals:
        setattr(cls, name, timed(getattr(cls, name), kind))
    per_step: dict[str, list[float]] = defaultdict(list)
    try:
        params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest("breakdown", list(range(100, 228)), params))
        engine.step()  # the prefill
        while engine.has_work():
            spent.clear()
            start = time.perf_counter()
            engine.step()
            per_step["step"].append(time.perf_counter() - start)
            for kind, seconds in spent.items():
                per_step[kind].append(seconds)
    finally:
        for cls, name, function in saved:
            setattr(cls, name, function)
    median = {kind: statistics.median(values) * 1e3 for kind, values in per_step.items()}
    layer_maps = sum(median.get(kind, 0.0) for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    return {**{kind: median.get(kind, 0.0) for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")},
            "layer maps": layer_maps, "lm_head": median.get("lm_head", 0.0),
            "rest of forward (attention, norms, RoPE, Python)": median["model forward"] - layer_maps,
            "engine outside the model": median["step"] - median["model forward"] - median["compute_logits"],
            "step": median["step"]}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the issue's comparison: 2)")
    parser.add_argument("--breakdown", action="store_true", help="also time the stored modes' decode step by part")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, torch threads {torch.get_num_threads()}", flush=True)
    engines = {name: LLMEngine(EngineConfig(model=str(args.model), dtype=args.dtype, quantization=quantization,
                                            kv_cache_memory_gb=0.5))
               for name, quantization in MODES.items()}
    for module in engines["stored-no-gemv"].loaded.model.modules():
        if isinstance(module, QuantizedLinear):
            module.integer_gemv = False
    best: dict[str, dict] = {name: {"step_s": float("inf"), "fastest_step_s": float("inf"), "prefill_s": float("inf"),
                                    "single_tok_s": 0.0, "batch_tok_s": 0.0} for name in MODES}
    for r in range(args.rounds):
        for name, engine in engines.items():
            step, fastest, prefill, single = single_stream(engine, first_token=100 + r)
            rate = batch(engine)
            print(f"{name}: decode step median {step * 1e3:.2f} ms, fastest {fastest * 1e3:.2f} ms, prefill of 128 "
                  f"{prefill * 1e3:.1f} ms, single stream "
                  f"{single:.1f} tok/s, 32 x 128 -> 64 {rate:.1f} tok/s", flush=True)
            mine = best[name]
            mine.update(step_s=min(mine["step_s"], step), fastest_step_s=min(mine["fastest_step_s"], fastest),
                        prefill_s=min(mine["prefill_s"], prefill),
                        single_tok_s=max(mine["single_tok_s"], single), batch_tok_s=max(mine["batch_tok_s"], rate))
    file_bytes = args.model.stat().st_size
    for name, engine in engines.items():
        loaded = engine.loaded
        floor = loaded.weight_bytes / bandwidth  # every weight read once per step
        best[name].update(storage=loaded.weight_storage, weight_bytes=loaded.weight_bytes,
                          weights_over_file=loaded.weight_bytes / file_bytes, bandwidth_floor_s=floor,
                          step_over_floor=best[name]["step_s"] / floor,
                          fastest_step_over_floor=best[name]["fastest_step_s"] / floor)
        b = best[name]
        print(f"{name} ({b['storage']}): weights {b['weight_bytes'] / 1e6:.1f} MB = {b['weights_over_file']:.2f}x "
              f"the file; step {b['step_s'] * 1e3:.2f} ms = {b['step_over_floor']:.2f}x the bandwidth floor "
              f"(fastest {b['fastest_step_s'] * 1e3:.2f} ms = {b['fastest_step_over_floor']:.2f}x) "
              f"({floor * 1e3:.2f} ms); prefill {b['prefill_s'] * 1e3:.1f} ms; single {b['single_tok_s']:.1f} tok/s; batch {b['batch_tok_s']:.1f} tok/s")
    stored, dequantized, before = best["stored"], best["dequantize"], best["stored-no-gemv"]
    print(f"stored / dequantized: single stream {stored['single_tok_s'] / dequantized['single_tok_s']:.2f}x, "
          f"batch {stored['batch_tok_s'] / dequantized['batch_tok_s']:.2f}x; stored / stored-no-gemv: single "
          f"stream {stored['single_tok_s'] / before['single_tok_s']:.2f}x, step {before['step_s'] / stored['step_s']:.2f}x "
          f"faster")
    if args.breakdown:
        for name in ("stored-no-gemv", "stored"):
            parts = best[name]["breakdown_ms"] = step_breakdown(engines[name])
            print(f"{name} decode step by part: " + ", ".join(f"{part} {ms:.2f} ms" for part, ms in parts.items()))
    write_json(args.json, {"args": arguments(args), "read_bandwidth_bytes_s": bandwidth, "file_bytes": file_bytes,
                           **best})


if __name__ == "__main__":
    main()
