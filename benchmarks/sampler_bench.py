"""Sampler time per step against a per-row loop and against softmax+argmax of the same tensor.

Rows carry mixed parameters: a quarter greedy, a quarter top-k (k <= 1024), a quarter
top-p that the top-k guess covers, a quarter top-k + top-p; temperatures 0.7-1.0. Logits
are peaked as a language model's are (a few strong candidates over a noisy floor).

    python benchmarks/sampler_bench.py [--json PATH]
"""

from __future__ import annotations

from pathlib import Path
import statistics
import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow  # noqa: E402


def mixed_params(batch: int) -> list[SamplingParams]:
    params = []
    for i in range(batch):
        temperature = 0.7 + 0.3 * (i % 4) / 3
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            params.append(SamplingParams(temperature=temperature, top_k=1 + (i * 37) % 1024))
        elif kind == 2:
            params.append(SamplingParams(temperature=temperature, top_p=0.9))
        else:
            params.append(SamplingParams(temperature=temperature, top_k=50, top_p=0.95))
    return params


def peaked_logits(batch: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g) * 2.0
    strong = torch.randint(0, vocab, (batch, 8), generator=g)
    logits.scatter_add_(1, strong, torch.full((batch, 8), 18.0))
    return logits


def per_row_loop(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """The straightforward way: one softmax, sort and torch.multinomial per request."""
    out = []
    for row, p in zip(logits, params):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k:
            row = row.masked_fill(row < row.topk(p.top_k).values[-1], -float("inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = (sorted_probs.cumsum(-1) - sorted_probs) > p.top_p
            probs = probs.index_fill(0, order[drop], 0.0)
        out.append(int(torch.multinomial(probs, 1)))
    return out


def timed(fn, repeats: int, setup=lambda: None) -> float:
    """Median seconds of fn(setup()) over ``repeats`` calls, after one warm-up; setup is not timed."""
    fn(setup())
    samples = []
    for _ in range(repeats):
        argument = setup()
        start = time.perf_counter()
        fn(argument)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = []
    print(f"{'batch':>6}{'vocab':>8}{'sampler ms':>12}{'loop ms':>10}{'argmax ms':>11}"
          f"{'vs argmax':>11}{'loop/sampler':>14}")
    for vocab in (32_000, 152_064):
        sampler = Sampler(torch.device("cpu"), vocab)
        for batch in (1, 32, 256):
            logits, params = peaked_logits(batch, vocab), mixed_params(batch)
            rows = [SamplingRow(p, seed=i + 1, prompt_ids=[], output_ids=[], eos_token_ids=[2])
                    for i, p in enumerate(params)]
            # The sampler works in place on the logits it is handed (in the engine, the LM head's fresh
            # output): each call gets its own copy, made outside the timed region. Building the
            # per-step SamplingBatch is timed.
            t_sampler = timed(lambda copy: sampler(copy, SamplingBatch.build(rows, vocab, logits.device)),
                              args.repeats, setup=logits.clone)
            t_loop = timed(lambda _: per_row_loop(logits, params), args.repeats)
            t_argmax = timed(lambda _: logits.softmax(-1).argmax(-1), args.repeats)
            row = dict(batch=batch, vocab=vocab, sampler_ms=t_sampler * 1e3, loop_ms=t_loop * 1e3,
                       softmax_argmax_ms=t_argmax * 1e3, sampler_vs_argmax=t_sampler / t_argmax,
                       loop_vs_sampler=t_loop / t_sampler)
            results.append(row)
            print(f"{batch:>6}{vocab:>8}{row['sampler_ms']:>12.2f}{row['loop_ms']:>10.2f}"
                  f"{row['softmax_argmax_ms']:>11.2f}{row['sampler_vs_argmax']:>10.2f}x"
                  f"{row['loop_vs_sampler']:>13.1f}x")
    write_json(args.json, {"torch_threads": torch.get_num_threads(), "results": results})


if __name__ == "__main__":
    main()
