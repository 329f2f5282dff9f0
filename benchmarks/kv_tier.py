"""The second KV tier (engine/kv_tier.py, ``kv_tier_gb``), measured on the engine in process.

(a) Eviction pressure: ``--docs`` documents of ``--doc-len`` tokens, each served once before the
    clock runs, then asked about again and again (the document, then a new ``--question-len``-token
    question; ``--new-tokens`` generated), one request at a time in a random order. The documents' KV is 1.3x the pool (``--pressure``): with an
    LRU pool alone about a quarter of the requests find their document evicted and compute it again;
    with the tier it is copied back. TTFT p50/p90 (submission to first token), prompt tokens computed,
    the tier's counters; with and without the tier.
(b) No reuse: the same shapes, every prompt new: the tier only spills (every eviction is a copy into
    it) and never hits. Mean TTFT and wall time, with and without it.

Each pair runs in alternated rounds (without, with, without, with ...); a figure is the median over
rounds. tiny-llama (or ``--model``: a model directory or a GGUF), CPU pool, the tier a memory-mapped
file in the system's temporary directory.

    python benchmarks/kv_tier.py [--model tiny-llama|PATH] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import json
from pathlib import Path
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.execution.model_runner import kv_bytes_per_token  # noqa: E402
from engine.kv_tier import TierCounts  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402

BLOCK = 16


def prompts(args, reuse: bool, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(each document once with a question, served before the clock; the requests' prompts in order:
    a random document and a new question each when ``reuse``, else every prompt new)."""
    rng = random.Random(0)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    docs = [words(args.doc_len) for _ in range(args.docs)]
    seen = [doc + words(args.question_len) for doc in docs]
    if reuse:
        return seen, [rng.choice(docs) + words(args.question_len) for _ in range(args.requests)]
    return seen, [words(args.doc_len + args.question_len) for _ in range(args.requests)]


def serve(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> dict:
    """One request at a time: TTFT of each, prompt tokens computed, wall time."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ttfts, computed, start = [], engine.scheduler.num_prompt_tokens_computed, time.perf_counter()
    for i, prompt in enumerate(batch):
        sent, first = time.perf_counter(), None
        engine.add_request(GenerationRequest(f"r{i}", prompt, params))
        while engine.has_work():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        ttfts.append(first - sent)
    ttfts.sort()
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * len(ttfts))],
            "ttft_mean_ms": 1000 * statistics.fmean(ttfts), "seconds": time.perf_counter() - start,
            "prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed - computed}


def measure(args, reuse: bool, tier_gb: float, num_blocks: int) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, block_size=BLOCK, num_blocks=num_blocks,
                                    max_num_batched_tokens=2048, kv_tier_gb=tier_gb, torch_threads=args.threads))
    docs, batch = prompts(args, reuse, engine.vocab_size)
    serve(engine, docs, 1)  # before the clock: the kernels' first calls, and the documents seen once
    if engine.blocks.tier is not None:
        engine.blocks.tier.counts = TierCounts()
    result = serve(engine, batch, args.new_tokens)
    if engine.blocks.tier is not None:
        result["tier"] = vars(engine.blocks.tier.counts)
    return result


def compare(args, reuse: bool, num_blocks: int, tier_gb: float) -> dict:
    """Alternated rounds without and with the tier; each figure the median over rounds."""
    rounds = {"without": [], "with": []}
    for _ in range(args.rounds):
        rounds["without"].append(measure(args, reuse, 0.0, num_blocks))
        rounds["with"].append(measure(args, reuse, tier_gb, num_blocks))
    out = {}
    for name, runs in rounds.items():
        out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "tier"}
        if "tier" in runs[-1]:
            out[name]["tier"] = runs[-1]["tier"]
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--pressure", type=float, default=1.3, help="the documents' KV over the pool's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    args = parser.parse_args()
    doc_blocks = args.docs * args.doc_len // BLOCK
    num_blocks = int(doc_blocks / args.pressure)
    probe = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, block_size=BLOCK, num_blocks=8))
    block_bytes = kv_bytes_per_token(probe.loaded) * BLOCK
    del probe
    tier_gb = 2 * doc_blocks * block_bytes / (1 << 30)  # room for every document: the tier is not the limit
    result = {"args": arguments(args), "torch_threads": torch.get_num_threads(), "pool_blocks": num_blocks,
              "document_blocks": doc_blocks, "block_bytes": block_bytes, "tier_gb": tier_gb}
    result["pressure"] = compare(args, True, num_blocks, tier_gb)
    result["no_reuse"] = compare(args, False, num_blocks, tier_gb)
    pressure, fresh = result["pressure"], result["no_reuse"]
    result["pressure_ttft_p90_ratio"] = pressure["without"]["ttft_p90_ms"] / pressure["with"]["ttft_p90_ms"]
    result["no_reuse_ttft_mean_ratio"] = fresh["with"]["ttft_mean_ms"] / fresh["without"]["ttft_mean_ms"]
    result["no_reuse_seconds_ratio"] = fresh["with"]["seconds"] / fresh["without"]["seconds"]
    print(json.dumps(result, indent=2))
    print(f"working set {args.pressure}x the pool: TTFT p90 {pressure['without']['ttft_p90_ms']:.1f} ms without the "
          f"tier, {pressure['with']['ttft_p90_ms']:.1f} ms with ({result['pressure_ttft_p90_ratio']:.2f}x); "
          f"no reuse: mean TTFT x{result['no_reuse_ttft_mean_ratio']:.3f}, wall x{result['no_reuse_seconds_ratio']:.3f}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
