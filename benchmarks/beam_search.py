"""Beam search throughput: the engine against transformers' ``generate(num_beams=k)`` on the same
model and prompts, in one run, for several beam widths; and the KV blocks a request holds with
the beams sharing blocks against what k unshared copies would need.

Model: SmolLM-135M's shape cut to 8 layers (benchmarks/engine_throughput.py), random weights.
Every request runs to ``--output-len`` tokens (no end id), so both sides do the same steps.
Throughput is output tokens per second of the best beam (what a client reads) and of all beams
(what was computed); width 1 is greedy decoding on both sides.

    python benchmarks/beam_search.py [--requests 8] [--widths 1 4 8] [--json PATH]
"""

from __future__ import annotations

import json
from pathlib import Path
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import SMOLLM_8L, make_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402


def prompts(count: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, SMOLLM_8L["vocab_size"], (length,), generator=generator).tolist() for _ in range(count)]


def time_transformers(model, ids: list[list[int]], width: int, output_len: int) -> float:
    batch = torch.tensor(ids)
    start = time.perf_counter()
    out = model.generate(batch, attention_mask=torch.ones_like(batch), num_beams=width, do_sample=False,
                         max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape == (len(ids), len(ids[0]) + output_len)
    return elapsed


def time_engine(engine: LLMEngine, ids: list[list[int]], width: int, output_len: int) -> tuple[float, int]:
    """Seconds for the batch, and the most KV blocks held at once."""
    params = (SamplingParams(max_new_tokens=output_len, beam_width=width, ignore_eos=True) if width > 1
              else SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    for i, prompt in enumerate(ids):
        engine.add_request(GenerationRequest(f"w{width}-{i}-{time.monotonic_ns()}", prompt, params))
    most, outputs = 0, []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.finished]
        most = max(most, engine.blocks.counts().held)
    elapsed = time.perf_counter() - start
    assert len(outputs) == len(ids) and all(o.num_output_tokens == output_len for o in outputs)
    assert engine.blocks.counts().held == 0
    return elapsed, most


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    ids = prompts(args.requests, args.input_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "smollm-8l")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # every beam runs to the length, as the engine's do
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory_gb=1.0))
        time_engine(engine, ids[:1], 2, 4)  # warm
        for width in args.widths:
            with torch.inference_mode():
                theirs = time_transformers(model, ids, width, args.output_len)
            ours, most = time_engine(engine, ids, width, args.output_len)
            best = args.requests * args.output_len
            unshared = width * engine.blocks.blocks_for(args.input_len + args.output_len)
            rows.append({"width": width, "engine_s": round(ours, 2), "transformers_s": round(theirs, 2),
                         "engine_best_beam_tok_s": round(best / ours, 1),
                         "engine_all_beams_tok_s": round(best * width / ours, 1),
                         "transformers_best_beam_tok_s": round(best / theirs, 1), "speedup": round(theirs / ours, 2),
                         "blocks_per_request_most": round(most / args.requests, 1),
                         "blocks_per_request_unshared": unshared})
            print(json.dumps(rows[-1]), flush=True)
    write_json(args.json, {"args": arguments(args), "rows": rows})


if __name__ == "__main__":
    main()
