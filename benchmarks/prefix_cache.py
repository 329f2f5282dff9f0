"""Prefix caching and shared prefills, measured on the engine in-process.

(a) Multi-turn chat: 16 conversations x 4 turns over one 1024-token system prompt. Each turn
    sends the whole history (system prompt, earlier turns, the replies) plus a new 32-token user
    message and generates 16 tokens; a turn's 16 requests go in together. Run with prefix caching
    on and off: TTFT p50/p99 (submission to first token), prefix-cache hit rate, prompt tokens
    computed, wall time.
(b) n = 4 choices of one 512-token prompt, 64 tokens each: prompt tokens computed and tokens/s,
    against 4 separate requests with prefix caching off.
(c) KV bytes per token for each dtype, and the pool's size against its configured budget.

    python benchmarks/prefix_cache.py [--dtype float32|bfloat16] [--json PATH]
"""

from __future__ import annotations

import json
from pathlib import Path
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import SMOLLM_8L, make_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.execution.model_runner import kv_bytes_per_token  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402


def random_ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, SMOLLM_8L["vocab_size"], (n,), generator=generator).tolist()


def multi_turn(engine: LLMEngine, conversations: int, turns: int, system_len: int, user_len: int,
               reply_len: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    system = random_ids(system_len, generator)
    histories = [list(system) for _ in range(conversations)]
    params = SamplingParams(max_new_tokens=reply_len, temperature=0.0, ignore_eos=True)
    ttfts = []
    start = time.perf_counter()
    for turn in range(turns):
        submitted = {}
        for c in range(conversations):
            histories[c] += random_ids(user_len, generator)
            rid = f"c{c}t{turn}"
            engine.add_request(GenerationRequest(rid, list(histories[c]), params))
            submitted[rid] = (c, time.perf_counter())
        while engine.has_work():
            for out in engine.step():
                c, sent = submitted[out.request_id]
                if out.num_output_tokens == 1 and out.new_token_ids:
                    ttfts.append(time.perf_counter() - sent)
                if out.finished:
                    histories[c] += out.output_token_ids
    blocks = engine.blocks
    return {"ttft_p50_ms": statistics.median(ttfts) * 1000, "ttft_p99_ms": sorted(ttfts)[int(0.99 * len(ttfts))] * 1000,
            "hit_rate": blocks.prefix_hits / blocks.prefix_queries, "prefix_hits": blocks.prefix_hits,
            "prefix_queries": blocks.prefix_queries,
            "prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed,
            "seconds": time.perf_counter() - start, "requests": len(ttfts)}


def n_choices(engine: LLMEngine, n: int, separate: bool, prompt_len: int, output_len: int) -> dict:
    prompt = random_ids(prompt_len, torch.Generator().manual_seed(1))
    params = SamplingParams(max_new_tokens=output_len, temperature=1.0, ignore_eos=True, seed=7)
    requests = ([GenerationRequest(f"s{j}", prompt, params) for j in range(n)] if separate
                else [GenerationRequest("n", prompt, params, n=n)])
    before = engine.scheduler.num_prompt_tokens_computed
    start = time.perf_counter()
    finals = engine.generate_choices(requests)
    seconds = time.perf_counter() - start
    generated = sum(out.num_output_tokens for outs in finals.values() for out in outs)
    assert generated == n * output_len
    return {"prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed - before,
            "tok_s": generated / seconds, "seconds": seconds}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=1024)
    args = parser.parse_args()
    result: dict = {"dtype": args.dtype, "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp)))
        config = dict(model=model_dir, dtype=args.dtype, kv_cache_memory_gb=1.0)
        for caching in (True, False):
            engine = LLMEngine(EngineConfig(enable_prefix_caching=caching, **config))
            result[f"multi_turn_caching_{'on' if caching else 'off'}"] = multi_turn(
                engine, args.conversations, args.turns, args.system_len, 32, 16)
        on, off = result["multi_turn_caching_on"], result["multi_turn_caching_off"]
        result["multi_turn_ttft_p50_ratio"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        result["n4_shared"] = n_choices(LLMEngine(EngineConfig(**config)), 4, False, 512, 64)
        result["n4_separate"] = n_choices(LLMEngine(EngineConfig(enable_prefix_caching=False, **config)), 4, True,
                                          512, 64)
        engine = LLMEngine(EngineConfig(**config))
        per_token = {d: kv_bytes_per_token(engine.loaded) * torch.empty((), dtype=getattr(torch, d)).element_size()
                     // engine.loaded.dtype.itemsize for d in ("float32", "bfloat16")}
        pool = engine.runner.kv_cache
        result["kv_bytes_per_token"] = per_token
        result["kv_pool_bytes"] = pool.numel() * pool.element_size()
        result["kv_budget_bytes"] = int(1.0 * (1 << 30))
    print(json.dumps(result, indent=2))
    print(f"multi-turn TTFT p50: {on['ttft_p50_ms']:.0f} ms with prefix caching, {off['ttft_p50_ms']:.0f} ms without "
          f"({result['multi_turn_ttft_p50_ratio']:.1f}x); hit rate {on['hit_rate']:.0%}")
    print(f"n=4: {result['n4_shared']['prompt_tokens_computed']} prompt tokens computed "
          f"({result['n4_separate']['prompt_tokens_computed']} as 4 requests), "
          f"{result['n4_shared']['tok_s']:.0f} vs {result['n4_separate']['tok_s']:.0f} tok/s")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
