"""Batched sampling with the Ascend aclnnTopKTopPSample semantics (docs/sampling.md)."""

from sampling.batch import SamplingBatch, SamplingRow
from sampling.params import SamplingParams
from sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingParams", "SamplingRow"]
