"""The decode step's host (Python) time, on the CPU: a proxy for what holds the CUDA path back.

On an H200 a Llama-1B decode step of 256 rows took 12.15 ms for ~2.5 ms of GPU work; the rest
was the engine's per-row Python (benchmarks/RESULTS.md, "GPU"). This runs the real ``LLMEngine``
on a random Llama so small (1 layer, hidden 16, tiny-llama's 1,024-token vocabulary) that its
math is negligible, so a decode step's time is the host's: the scheduler, the step's inputs,
the sampler's batch, output processing and detokenization. Greedy, EOS ignored, the GPU
benchmark's settings otherwise (max_num_seqs 256).

It reports, per batch size, ms per decode step and, from the two sizes, the cost of one more
row (µs per row per step: the slope, free of the step's fixed cost); per phase, the CPU time of
decode steps at the largest size, unprofiled (the model forward and LM head apart: on this
proxy they are the attention kernel's math over 512-token contexts, not host work); then a
cProfile of decode steps at that size grouped by where the time goes. It also times the CUDA graph's input
staging alone (``engine/execution/cuda_graphs.py``'s host side, which needs no GPU).

    python benchmarks/host_overhead.py [--rows 64 256] [--steps 48] [--prompt 512] [--repeats 3] [--controls 0.1]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
from pathlib import Path
import pstats
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from tests.models import make_random_model  # noqa: E402

# Where a profiled function's own time is counted: the first of these its file path contains.
AREAS = [
    ("scheduler", ("engine/scheduler.py", "engine/block_manager.py")),
    ("step inputs (runner, attention metadata, graphs)", ("engine/execution/model_runner.py",
                                                         "engine/execution/attention/", "cuda_graphs.py")),
    ("model forward (torch ops)", ("engine/execution/model.py", "engine/execution/fused_ops.py", "torch/nn/")),
    ("sampler batch and sampler", ("sampling/",)),
    ("detokenizer", ("engine/detokenizer.py", "tokenizers")),
    ("output processing (engine loop, outputs)", ("engine/llm_engine.py", "engine/outputs.py",
                                                 "engine/request.py", "engine/decoding/")),
]


def tiny_config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                       bos_token_id=1, eos_token_id=2)


def make_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_blocks=20000, block_size=16,
                                  max_num_seqs=256, max_num_batched_tokens=8192, batch_invariant=False,
                                  enable_prefix_caching=True))


# The sampling controls a ``--controls`` share of the rows asks for: penalties and a logit bias.
CONTROLS = dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, logit_bias={5: 0.5})


def add_requests(llm: LLMEngine, rows: int, prompt: int, new: int, tag: str, controls: float = 0.0) -> None:
    """``rows`` greedy requests; a ``controls`` share of them, spread through the batch, with CONTROLS."""
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, 880, (rows, prompt), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    controlled = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True, **CONTROLS)
    for i, p in enumerate(ids):
        with_controls = int((i + 1) * controls) > int(i * controls)
        llm.add_request(GenerationRequest(f"{tag}{i}", p, controlled if with_controls else params))


def past_prefill(llm: LLMEngine, rows: int) -> None:
    started = set()
    while len(started) < rows:
        started.update(out.request_id for out in llm.step())


def new_tokens(llm: LLMEngine, rows: int, prompt: int, steps: int) -> int:
    """Output tokens per request: the prefill's steps (the first requests decode meanwhile) and ``steps`` more."""
    return steps + rows * prompt // llm.config.max_num_batched_tokens + 4


def decode_ms(llm: LLMEngine, rows: int, prompt: int, steps: int, tag: str, controls: float = 0.0) -> float:
    """CPU ms per decode step over ``steps`` steps of ``rows`` rows, after their prefill. The
    process's CPU time, not the wall clock: on a shared machine another process's work is not
    counted (torch runs on this thread alone, --threads 1)."""
    add_requests(llm, rows, prompt, new_tokens(llm, rows, prompt, steps), tag, controls)
    past_prefill(llm, rows)
    start = time.process_time()
    for _ in range(steps):
        outs = llm.step()
        assert len(outs) == rows, len(outs)
    elapsed = time.process_time() - start
    while llm.has_work():
        llm.step()
    return 1e3 * elapsed / steps


def profile(llm: LLMEngine, rows: int, prompt: int, steps: int, controls: float) -> tuple[list[tuple[str, float]], str]:
    """Per area, the profiled ms per step (own time); and cProfile's top functions."""
    add_requests(llm, rows, prompt, new_tokens(llm, rows, prompt, steps), "prof", controls)
    past_prefill(llm, rows)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.step()
    profiler.disable()
    while llm.has_work():
        llm.step()
    stats = pstats.Stats(profiler)
    totals = {name: 0.0 for name, _ in AREAS} | {"other (torch C calls, builtins)": 0.0}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        area = next((name for name, parts in AREAS if any(p in filename for p in parts)),
                    "other (torch C calls, builtins)")
        totals[area] += tottime
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return [(name, 1e3 * t / steps) for name, t in totals.items()], text.getvalue()


# (object path from the engine, method, label): each method's process CPU time is summed per step.
PHASES = [
    ("scheduler", "schedule", "scheduler.schedule"),
    ("runner", "run", "runner.run (inputs, forward, sampler)"),
    ("loaded.model", "forward", "  model forward"),
    ("loaded.model", "compute_logits", "  LM head"),
    ("runner", "_sample_step", "  sampler batch and sampler"),
    ("scheduler", "commit", "scheduler.commit"),
    ("", "_postprocess_decode", "outputs (tokens, stops, text, RequestOutput)"),
    ("", "_postprocess", "outputs on the per-row path (a step not from the columns)"),
]


def phases_us(llm: LLMEngine, rows: int, prompt: int, steps: int, controls: float) -> tuple[float, dict[str, float]]:
    """µs per row per decode step: in all, and in each of PHASES (their methods timed in place)."""
    spent: dict[str, float] = {}
    originals = []
    for path, name, label in PHASES:
        owner = llm
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        method = getattr(owner, name)

        def timed(*args, _method=method, _label=label, **kwargs):
            start = time.process_time()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.process_time() - start

        originals.append((owner, name))
        setattr(owner, name, timed)
    add_requests(llm, rows, prompt, new_tokens(llm, rows, prompt, steps), "phase", controls)
    past_prefill(llm, rows)
    spent.clear()
    start = time.process_time()
    for _ in range(steps):
        llm.step()
    total = time.process_time() - start
    for owner, name in originals:
        delattr(owner, name)  # the class's method again
    while llm.has_work():
        llm.step()
    scale = 1e6 / (steps * rows)
    return total * scale, {label: t * scale for label, t in spent.items()}


def graph_staging_us(llm: LLMEngine, rows: int, prompt: int, repeats: int = 50) -> float | None:
    """µs per call of the CUDA graph's host-side input staging for a decode step of ``rows``
    rows, on this engine's running sequences (None where this tree has no such function)."""
    try:
        from engine.execution.cuda_graphs import GraphInputs
    except ImportError:
        return None
    add_requests(llm, rows, prompt, 8, "stage")
    past_prefill(llm, rows)
    seqs = list(llm.scheduler.running)
    staging = GraphInputs(rows, -(-llm.max_model_len // llm.config.block_size), pinned=False)
    positions = np.array([s.num_tokens - 1 for s in seqs])
    ids = np.array([s.token_ids[-1] for s in seqs])
    slots = positions  # any values: only the staging's cost is measured
    start = time.process_time()
    for _ in range(repeats):
        staging.fill(ids, positions, slots, [s.block_table for s in seqs], rows)
    elapsed = time.process_time() - start
    while llm.has_work():
        llm.step()
    return 1e6 * elapsed / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (the GPU workload's)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the host's own cost)")
    parser.add_argument("--controls", type=float, default=0.0,
                        help="share of the rows (0-1) asking for penalties and a logit bias (CONTROLS)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads {args.threads}; "
          f"rows with penalties and a bias: {args.controls:.0%}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model(Path(tmp) / "model", "llama", make_config=tiny_config)
        llm = make_engine(model_dir)
        decode_ms(llm, 16, args.prompt, 8, "warm")
        per_size = {}
        for rows in args.rows:
            runs = [decode_ms(llm, rows, args.prompt, args.steps, f"r{rows}x{k}-", args.controls)
                    for k in range(args.repeats)]
            per_size[rows] = statistics.median(runs)
            print(f"{rows:4d} rows: {per_size[rows]:.2f} ms per decode step "
                  f"({1e3 * per_size[rows] / rows:.1f} µs per row; runs {', '.join(f'{r:.2f}' for r in runs)})")
        if len(per_size) >= 2:
            small, large = min(per_size), max(per_size)
            slope = 1e3 * (per_size[large] - per_size[small]) / (large - small)
            print(f"one more row: {slope:.1f} µs per step (slope {small} -> {large} rows); "
                  f"fixed cost {per_size[small] - slope * small / 1e3:.2f} ms per step")
        staging = graph_staging_us(llm, max(args.rows), args.prompt)
        if staging is not None:
            print(f"CUDA graph input staging (host side), {max(args.rows)} rows: {staging:.0f} µs per step")
        rows = max(args.rows)
        total, phases = phases_us(llm, rows, args.prompt, args.steps, args.controls)
        forward = phases.get("  model forward", 0.0) + phases.get("  LM head", 0.0)
        print(f"\nPer phase, {rows} rows, µs per row per step (unprofiled; {total:.1f} in all, "
              f"{total - forward:.1f} but the model forward and LM head):")
        for _, _, label in PHASES:
            print(f"  {label:52s} {phases.get(label, 0.0):6.1f}")
        areas, top = profile(llm, max(args.rows), args.prompt, min(args.steps, 24), args.controls)
        print(f"\ncProfile, {max(args.rows)} rows, own time per decode step (profiled, so inflated):")
        for name, ms in areas:
            print(f"  {name:52s} {ms:6.2f} ms")
        print(top)


if __name__ == "__main__":
    main()
