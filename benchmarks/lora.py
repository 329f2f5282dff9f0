"""Multi-LoRA throughput: a batch whose requests use 1, 4 or 16 distinct adapters against the same
batch on the base model, in one run.

Model: SmolLM-135M's shape cut to 8 layers (benchmarks/engine_throughput.py), random weights,
fp32; adapters of rank ``--rank`` on all seven maps of every layer (q, k, v, o, gate, up, down),
random. Requests are spread over the adapters round-robin; every request runs to
``--output-len`` tokens. Throughput is output tokens per second over the whole run (prefill and
decode), and decode tokens per second from the step that gave every request its first token.

    python benchmarks/lora.py [--requests 32] [--adapters 1 4 16] [--rank 8] [--json PATH]
"""

from __future__ import annotations

import json
from pathlib import Path
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import SMOLLM_8L, make_model  # noqa: E402
from benchmarks.speculative import prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.lora_adapter import TARGETS, LoraAdapter, ModelShape  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402


def random_adapter(name: str, shape: ModelShape, rank: int, seed: int) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(shape.num_layers):
        for target in TARGETS:
            d_in, d_out = shape.dims[target]
            weights[(layer, target)] = (rng.normal(0, 0.02, (rank, d_in)).astype(np.float32),
                                        rng.normal(0, 0.02, (d_out, rank)).astype(np.float32))
    return LoraAdapter.of(name, weights)


def run(engine: LLMEngine, ids: list[list[int]], output_len: int, adapters: list[LoraAdapter]) -> dict:
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.blocks.reset_prefix_cache()  # every run computes its prompts
    start = time.perf_counter()
    for i, prompt in enumerate(ids):
        lora = adapters[i % len(adapters)] if adapters else None
        engine.add_request(GenerationRequest(f"r{i}", prompt, params, lora=lora.ref if lora else None), lora=lora)
    seen, decode_start, tokens = set(), None, 0
    while engine.has_work():
        for out in engine.step():
            seen.add(out.request_id)
            tokens += len(out.new_token_ids)
        if decode_start is None and len(seen) == len(ids):
            decode_start = time.perf_counter()
    end = time.perf_counter()
    assert tokens == len(ids) * output_len and engine.blocks.counts().held == 0
    return {"adapters": len(adapters), "total_s": round(end - start, 3), "tok_s": round(tokens / (end - start), 1),
            "decode_tok_s": round(len(ids) * (output_len - 1) / (end - decode_start), 1)}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ids = prompts(args.requests, args.input_len, False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(EngineConfig(model=str(make_model(Path(tmp) / "smollm-8l")), dtype="float32",
                                        kv_cache_memory_gb=1.0))
        shape = ModelShape.of(engine.loaded.spec)
        pool = [random_adapter(f"a{j}", shape, args.rank, j) for j in range(max(args.adapters))]
        run(engine, ids[:2], 4, pool[:1])  # warm
        base = run(engine, ids, args.output_len, [])
        rows.append({**base, "of_base": 1.0, "decode_of_base": 1.0})
        print(json.dumps(rows[-1]), flush=True)
        for count in args.adapters:
            row = run(engine, ids, args.output_len, pool[:count])
            row.update(of_base=round(row["tok_s"] / base["tok_s"], 3),
                       decode_of_base=round(row["decode_tok_s"] / base["decode_tok_s"], 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_json(args.json, {"args": arguments(args), "model": SMOLLM_8L, "rows": rows})


if __name__ == "__main__":
    main()
