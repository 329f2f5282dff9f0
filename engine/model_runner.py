"""The model runner owns the device: the weights, the KV pool, the forward and the sampler.

``run`` turns a ScheduledBatch into one flat batch of tokens, runs one forward over it,
computes logits only for the rows that sample, and samples them.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import build_attention_batch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_transfer import KVMeta, numpy_to_tensor, tensor_to_numpy
from engine.loader import LoadedModel
from engine.request import Sequence
from engine.scheduler import ScheduledBatch
from sampling import Sampler, SamplerOutput, SamplingBatch, SamplingRow


def kv_pool_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """Blocks in the pool: ``num_blocks``, or as many as ``kv_cache_memory_gb`` holds."""
    if config.num_blocks is not None:
        return config.num_blocks
    spec = loaded.spec
    element = torch.empty((), dtype=loaded.dtype).element_size()
    block_bytes = spec.num_layers * 2 * config.block_size * spec.num_kv_heads * spec.head_dim * element
    return max(1, int(config.kv_cache_memory_gb * (1 << 30)) // block_bytes)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, blocks: BlockManager, config: EngineConfig) -> None:
        self.loaded = loaded
        self.blocks = blocks
        self.device = loaded.device
        spec = loaded.spec
        # [layers, k/v, slots, kv_heads, head_dim], allocated once.
        self.kv_cache = torch.zeros(spec.num_layers, 2, blocks.num_blocks * blocks.block_size, spec.num_kv_heads,
                                    spec.head_dim, dtype=loaded.dtype, device=self.device)
        self.sampler = Sampler(self.device, spec.vocab_size, config.top_k_guess, config.sampler_backend)
        self.windows = set(spec.layer_windows)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One throw-away forward of a full step's tokens at start-up (as vLLM's profile run):
        the first real request then finds the allocator and the kernels warm. It writes KV
        into pool slots that no sequence owns yet; every slot is written by its owner before
        it is read."""
        num_tokens = min(num_tokens, self.kv_cache.shape[2], self.loaded.spec.max_position)
        slots = list(range(num_tokens))
        attn = build_attention_batch(slots, [], [(0, num_tokens, 0, slots)], self.windows, self.blocks.block_size,
                                     self.device)
        positions = torch.arange(num_tokens, device=self.device)
        hidden = self.loaded.model(torch.zeros_like(positions), positions, attn, self.kv_cache)
        self.loaded.model.compute_logits(hidden[-1:])

    def kv_meta(self, num_tokens: int) -> KVMeta:
        spec = self.loaded.spec
        return KVMeta(self.loaded.model_id, str(self.loaded.dtype).removeprefix("torch."), spec.num_layers,
                      spec.num_kv_heads, spec.head_dim, num_tokens)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, rows: list[SamplingRow]) -> SamplerOutput | None:
        """One forward over every entry of ``batch``; sample for the entries that reach their
        last token (``rows``, in entry order). Imports pending KV first."""
        for seq in batch.kv_imports:
            self.import_kv(seq)
        input_ids, positions, slot_mapping, decodes, prefills, sample_rows = [], [], [], [], [], []
        for seq, n in batch.entries:
            start = seq.num_computed_tokens
            flat = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slot_mapping.extend(self.blocks.slots(seq, start, start + n))
            if n == 1:
                decodes.append((flat, start + 1, seq.block_table))
            else:
                prefills.append((flat, n, start, self.blocks.slots(seq, 0, start + n)))
            if batch.samples(seq, n):
                sample_rows.append(flat + n - 1)
        attn = build_attention_batch(slot_mapping, decodes, prefills, self.windows, self.blocks.block_size,
                                     self.device)
        model = self.loaded.model
        hidden = model(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                       attn, self.kv_cache)  # [N, H]
        if not sample_rows:
            return None
        logits = model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])  # [R, V]
        return self.sampler(logits, SamplingBatch.build(rows, self.loaded.spec.vocab_size, self.device))

    def export_kv(self, seq: Sequence) -> np.ndarray:
        """The KV of the prompt's tokens as one contiguous array [L, 2, T, Hkv, D]."""
        slots = torch.tensor(self.blocks.slots(seq, 0, seq.num_prompt_tokens), device=self.device)
        return tensor_to_numpy(self.kv_cache[:, :, slots])

    def import_kv(self, seq: Sequence) -> None:
        payload = seq.pending_kv
        slots = torch.tensor(self.blocks.slots(seq, 0, payload.meta.num_tokens), device=self.device)
        self.kv_cache[:, :, slots] = numpy_to_tensor(payload.data, self.loaded.dtype).to(self.device)
        seq.pending_kv = None
