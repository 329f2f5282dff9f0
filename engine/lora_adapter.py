"""LoRA adapters: what one is and the two forms it arrives in (plain data: the request carries a
``LoraRef``, the engine the ``LoraAdapter``; engine/execution/lora.py applies them in a step).

An adapter adds ``B @ (A @ x)`` to the output of some of a layer's linear maps (LoRA, Hu et
al. 2021), A [r, in] and B [out, r], the scale folded into B. The base weights are never
merged: requests with different adapters (and none) share one step, and each row of the flat
batch gets its own adapter's delta (engine/execution/lora.py ``LoraStep``).

Two forms in (both checked against the served model, mistakes raise ValueError naming the field):
- a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), as
  ``PeftModel.from_pretrained`` reads it; scale lora_alpha / r (or / sqrt(r) with rsLoRA);
- TensorRT-LLM's tensors (seed 004): ``lora_config`` [rows, 3] = (module id, layer, rank) and
  ``lora_weights`` [rows, r * in + out * r (+ padding)], each row A then B flattened row-major,
  the scale already in them (as TensorRT-LLM's converter writes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import hashlib
import json
import math
from pathlib import Path
import re

import numpy as np
import torch

# A layer's adapted maps: (fused weight they live in, their slice of its output is the engine's).
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}
# TensorRT-LLM's module ids (docs/source/advanced/lora.md); 0 (attn_qkv) is one A for q, k and v.
TRTLLM_MODULES = {0: "qkv", 1: "q", 2: "k", 3: "v", 4: "o", 5: "up", 6: "down", 7: "gate"}


@dataclass(frozen=True)
class LoraRef:
    """What travels with a request: the adapter's name and its content's digest (the KV key's part)."""

    name: str
    digest: bytes


@dataclass(frozen=True)
class ModelShape:
    """The served model's sizes an adapter must fit: (in, out) of each target, and the layers."""

    num_layers: int
    dims: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, spec) -> "ModelShape":
        """From an engine ModelSpec."""
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        h, i = spec.hidden_size, spec.intermediate_size
        return cls(spec.num_layers, {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i),
                                     "up": (h, i), "down": (i, h)})


@dataclass(eq=False)
class LoraAdapter:
    """(layer, target) -> (A [r, in], B [out, r]) float32, the scale in B."""

    ref: LoraRef
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    _memo: dict = field(default_factory=dict, repr=False)  # the engine's tensors and checks, made once

    @classmethod
    def of(cls, name: str, weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> "LoraAdapter":
        digest = hashlib.blake2b(digest_size=16)
        for key in sorted(weights):
            a, b = weights[key]
            digest.update(repr(key).encode() + a.tobytes() + b.tobytes())
        return cls(LoraRef(name, digest.digest()), weights)

    def __getstate__(self) -> dict:  # sent between processes without the engine's tensors
        return {**self.__dict__, "_memo": {}}

    def check(self, shape: ModelShape, max_rank: int, where: str = "lora") -> None:
        """Raise ValueError if the adapter does not fit the model or the rank limit (checked once each)."""
        fit = ("fits", shape.num_layers, tuple(sorted(shape.dims.items())), max_rank)
        if fit in self._memo:
            return
        for (layer, target), (a, b) in self.weights.items():
            d_in, d_out = shape.dims[target]
            if not 0 <= layer < shape.num_layers:
                raise ValueError(f"{where}: layer {layer} is outside the model's {shape.num_layers} layers")
            if a.shape[0] > max_rank:
                raise ValueError(f"{where}: rank {a.shape[0]} is over this server's max_lora_rank ({max_rank})")
            if a.shape != (a.shape[0], d_in) or b.shape != (d_out, a.shape[0]):
                raise ValueError(f"{where}: layer {layer} {target}: A {list(a.shape)} and B {list(b.shape)}, "
                                 f"this model needs [r, {d_in}] and [{d_out}, r]")
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                raise ValueError(f"{where}: layer {layer} {target}: values must be finite")
        self._memo[fit] = True

    def tensors(self, layer: int, target: str, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [r, in], B [out, r]) in the engine's dtype, made once; None where the adapter has none."""
        key = (layer, target, dtype, device)
        if key not in self._memo:
            pair = self.weights.get((layer, target))
            self._memo[key] = None if pair is None else tuple(
                torch.from_numpy(m).to(device, dtype) for m in pair)
        return self._memo[key]


def from_peft(name: str, directory: str | Path) -> LoraAdapter:
    """A PEFT LoRA adapter directory, for a Llama-family model (engine/execution/model.py's maps)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    where = f"lora_modules: {name}"
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: no readable adapter_config.json in {directory} ({error})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    for key, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("fan_in_fan_out", False),
                     ("alpha_pattern", {}), ("layer_replication", None)):
        if config.get(key) not in (None, off):
            raise ValueError(f"{where}: {key}={config[key]!r} is not supported")
    path = directory / "adapter_model.safetensors"
    if not path.exists():  # adapter_model.bin is a pickle: never loaded
        raise ValueError(f"{where}: no adapter_model.safetensors in {directory}")
    tensors = load_file(str(path))
    pattern = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = pattern.fullmatch(key)
        if match is None or match.group(2) not in PEFT_MODULES:
            raise ValueError(f"{where}: tensor {key!r} adapts no map this server adapts ({', '.join(PEFT_MODULES)})")
        layer, target = int(match.group(1)), PEFT_MODULES[match.group(2)]
        halves.setdefault((layer, target), {})[match.group(3)] = value.astype(np.float32)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    weights = {}
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {key[0]} {key[1]} lacks lora_{'B' if 'A' in pair else 'A'}")
        rank = pair["A"].shape[0]
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        weights[key] = (np.ascontiguousarray(pair["A"]), np.ascontiguousarray(pair["B"] * scale))
    return LoraAdapter.of(name, weights)


def from_trtllm(name: str, weights: np.ndarray, config: np.ndarray, shape: ModelShape) -> LoraAdapter:
    """TensorRT-LLM's ``lora_weights`` [rows, W] and ``lora_config`` [rows, 3] (module id, layer, rank)."""
    if config.ndim != 2 or config.shape[1] != 3:
        raise ValueError(f"lora_config: shape {list(config.shape)}, expected [rows, 3] (module id, layer, rank)")
    if weights.ndim != 2 or weights.shape[0] != config.shape[0]:
        raise ValueError(f"lora_weights: shape {list(weights.shape)}, expected one row per lora_config row "
                         f"[{config.shape[0]}, D x Hi + Ho x D]")
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for row, (module, layer, rank) in enumerate(config.tolist()):
        target = TRTLLM_MODULES.get(module)
        if target is None:
            raise ValueError(f"lora_config: row {row}: module id {module} is not one this model adapts "
                             f"({', '.join(f'{i} {t}' for i, t in TRTLLM_MODULES.items())})")
        if rank < 1:
            raise ValueError(f"lora_config: row {row}: adapter size {rank} must be >= 1")
        parts = ("q", "k", "v") if target == "qkv" else (target,)
        d_in = shape.dims[parts[0]][0]
        d_out = sum(shape.dims[p][1] for p in parts)
        need = rank * d_in + d_out * rank
        if need > weights.shape[1]:
            raise ValueError(f"lora_weights: row {row} has {weights.shape[1]} values; module {module} at rank "
                             f"{rank} needs {need} (r x {d_in} + {d_out} x r)")
        a = np.ascontiguousarray(weights[row, :rank * d_in].reshape(rank, d_in), dtype=np.float32)
        b = np.asarray(weights[row, rank * d_in:need].reshape(d_out, rank), dtype=np.float32)
        start = 0
        for part in parts:  # attn_qkv: one A, B split by output rows into q, k and v
            size = shape.dims[part][1]
            if (layer, part) in out:
                raise ValueError(f"lora_config: row {row}: layer {layer} {part} is adapted twice")
            out[(layer, part)] = (a, np.ascontiguousarray(b[start:start + size]))
            start += size
    return LoraAdapter.of(name, out)
