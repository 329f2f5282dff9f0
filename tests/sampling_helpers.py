"""Building sampler inputs by hand."""

import torch

from sampling import SamplingBatch, SamplingParams, SamplingRow


def batch_of(params: list[SamplingParams], vocab: int, seeds: list[int] | None = None,
             prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
             eos: list[int] = (2,)) -> SamplingBatch:
    n = len(params)
    seeds = seeds or [1000 + i for i in range(n)]
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    rows = [SamplingRow(p, s, pr, o, list(eos)) for p, s, pr, o in zip(params, seeds, prompts, outputs)]
    return SamplingBatch.build(rows, vocab, torch.device("cpu"))
