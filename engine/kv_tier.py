"""The second KV tier behind a pool: full blocks evicted from the pool, kept by their prefix-cache key.

A cached block the pool reuses for another request loses its content; with a tier, its KV is first
copied here (a *spill*), and a later prefix look-up that ends in the pool goes on here: a block found
is copied back into a new pool block (a *copy-back*) instead of being computed again (docs/serving.md,
"The second KV tier"). Behind a CPU pool the tier is a memory-mapped file in a temporary directory
(the page cache holds what fits, the disk the rest); behind a CUDA pool it is host memory, pinned.

The keys are the prefix cache's own chain hashes (engine/block_manager.py ``chain_hash``): model,
dtype, LoRA adapter and prompt table are in them, so a block is found only by the same content.

Bounded in bytes: ``capacity`` blocks, the least recently used ready entry given up first. An entry
is *writing* from ``reserve`` until the runner has copied the block in (``written``): a look-up never
finds it before, so nothing is served from a half-written entry. This class keeps the ledger and the
storage; the block manager decides what moves (``TierMove``) and the model runner moves the bytes,
in the order they were decided.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
import os
import tempfile

import torch


@dataclass(frozen=True)
class TierMove:
    """One block's copy between the pool and the tier: ``spill`` pool -> tier, else tier -> pool."""

    spill: bool
    block: int  # the pool block
    slot: int  # the tier entry
    key: bytes


@dataclass
class TierCounts:
    """What the tier has done since start-up (blocks, and bytes copied each way)."""

    hits: int = 0  # look-ups found here: each one block copied back instead of computed
    spills: int = 0  # blocks copied in from the pool
    spilled_bytes: int = 0
    copy_backs: int = 0  # blocks copied back into the pool
    copied_back_bytes: int = 0
    evictions: int = 0  # entries given up for room


class KVTier:
    def __init__(self, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pool_device: torch.device, directory: str | None = None) -> None:
        """``block_shape``: one pool block's KV, [layers, k/v, block_size * kv_heads * head_dim] elements."""
        element = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = element * torch.Size(block_shape).numel()
        self.capacity = capacity_bytes // self.block_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_tier_gb: holds no block (a block is {self.block_bytes} bytes)")
        layers, kv, elements = block_shape
        shape = (layers, kv, self.capacity, elements)  # [L, 2, entries, B*Hkv*D]: the pool's layout by block
        if pool_device.type == "cpu":
            self.storage = _mapped_file(shape, dtype, directory)
        else:  # host memory behind a device pool; pinned, so that copies are DMA
            self.storage = torch.empty(shape, dtype=dtype, pin_memory=pool_device.type == "cuda")
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # key -> entry, least recently used first
        self._writing: dict[bytes, int] = {}  # reserved, not yet copied in
        self._free = list(range(self.capacity - 1, -1, -1))
        self.counts = TierCounts()

    def __len__(self) -> int:
        return len(self._ready)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ready or key in self._writing

    def lookup(self, key: bytes) -> int | None:
        """The entry of a ready block of ``key`` (now the most recently used), else None."""
        slot = self._ready.get(key)
        if slot is not None:
            self._ready.move_to_end(key)
            self.counts.hits += 1
        return slot

    def reserve(self, key: bytes) -> int | None:
        """An entry for ``key``'s block, writing until ``written``; None when no copy is needed (the
        key is here already: it becomes the most recently used) or every entry is being written."""
        if key in self._ready:
            self._ready.move_to_end(key)
            return None
        if key in self._writing:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._ready:
            slot = self._ready.popitem(last=False)[1]
            self.counts.evictions += 1
        else:
            return None
        self._writing[key] = slot
        return slot

    def written(self, keys: list[bytes]) -> None:
        """The blocks of ``keys`` are copied in: look-ups may find them. A key dropped meanwhile
        (``clear``) is ignored."""
        for key in keys:
            slot = self._writing.pop(key, None)
            if slot is not None:
                self._ready[key] = slot
        self.counts.spills += len(keys)
        self.counts.spilled_bytes += len(keys) * self.block_bytes

    def copied_back(self, num_blocks: int) -> None:
        self.counts.copy_backs += num_blocks
        self.counts.copied_back_bytes += num_blocks * self.block_bytes

    def clear(self) -> None:
        """Forget every entry (new weights: the KV is stale). Moves already decided still read and
        write their entries' bytes, in order; only the ledger forgets."""
        self._ready.clear()
        self._writing.clear()
        self._free = list(range(self.capacity - 1, -1, -1))


def _mapped_file(shape: tuple[int, ...], dtype: torch.dtype, directory: str | None) -> torch.Tensor:
    """A tensor of ``shape`` backed by a new file in ``directory`` (the system's temporary one when
    None), mapped shared; the file is unlinked at once, so it goes away with the process."""
    numel = torch.Size(shape).numel()
    with tempfile.NamedTemporaryFile(dir=directory, prefix="pdserve-kv-tier-", delete=False) as file:
        file.truncate(numel * torch.empty((), dtype=dtype).element_size())
    try:
        return torch.from_file(file.name, shared=True, size=numel, dtype=dtype).view(shape)
    finally:
        os.unlink(file.name)
