"""A step's LoRA deltas: the adapters of the requests in a batched step (engine/lora_adapter.py,
what an adapter is), stacked per target and applied to each row with its own adapter's columns.
The base weights are never merged: requests with different adapters (and none) share one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.execution.model import linear
from engine.lora_adapter import LoraAdapter


class LoraStacks:
    """The adapters of a step, per target: their A stacked ([R, in], R = the sum of their ranks)
    and their B side by side ([out, R]), made on first use. The model runner keeps one while
    the set of adapters in its steps stays the same (decode steps)."""

    def __init__(self, adapters: list[LoraAdapter], dtype: torch.dtype, device: torch.device) -> None:
        self.adapters, self.dtype, self.device = adapters, dtype, device
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, tuple] | None] = {}

    def get(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor, tuple] | None:
        """(A_all, B_all, layout: (adapter index, rank) per block of R); None when no adapter has it."""
        key = (layer, target)
        if key not in self._stacks:
            pairs = [(j, adapter.tensors(layer, target, self.dtype, self.device))
                     for j, adapter in enumerate(self.adapters)]
            pairs = [(j, pair) for j, pair in pairs if pair is not None]
            self._stacks[key] = None if not pairs else (
                torch.cat([a for _, (a, _) in pairs]), torch.cat([b for _, (_, b) in pairs], 1),
                tuple((j, a.shape[0]) for j, (a, _) in pairs))
        return self._stacks[key]


class LoraStep:
    """One step's LoRA deltas: a row's delta for a target is ((x @ A_all^T) * mask) @ B_all^T,
    its mask keeping its own adapter's columns (zero for a row without one). Two matmuls a
    target whatever the number of adapters: no loop over them, no merged weights."""

    def __init__(self, stacks: LoraStacks, row_adapter: torch.Tensor) -> None:
        """``row_adapter`` [N] int64 on the device: each row's index in ``stacks.adapters``, -1 for none."""
        self.stacks, self.row_adapter = stacks, row_adapter
        self._masks: dict[tuple, torch.Tensor] = {}

    def layer(self, index: int) -> "LayerLora":
        return LayerLora(self, index)

    def mask(self, layout: tuple) -> torch.Tensor:
        """[N, R]: 1 where column's adapter is the row's."""
        if layout not in self._masks:
            owner = torch.cat([torch.full((rank,), j, dtype=torch.int64) for j, rank in layout])
            owner = owner.to(self.row_adapter.device)
            self._masks[layout] = (self.row_adapter[:, None] == owner[None, :]).to(self.stacks.dtype)
        return self._masks[layout]


@dataclass
class LayerLora:
    """A LoraStep seen from one layer: adds each target's delta into its slice of a fused output."""

    step: LoraStep
    index: int

    def add(self, targets: tuple[str, ...], x: torch.Tensor, out: torch.Tensor, sizes: tuple[int, ...]) -> None:
        """x [N, in]; out [N, sum(sizes)], the fused map's output, ``targets`` its slices in order."""
        start = 0
        for target, size in zip(targets, sizes):
            stacked = self.step.stacks.get(self.index, target)
            if stacked is not None:
                a, b, layout = stacked
                out[:, start:start + size] += linear(linear(x, a) * self.step.mask(layout), b)
            start += size
