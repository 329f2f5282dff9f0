"""The KV that travels from P to D: one contiguous numpy buffer and the metadata D checks.

numpy, not torch: Ray's object store hands numpy arrays to readers without a copy, while a
torch tensor is pickled. numpy has no bfloat16, so bf16 travels as an int16 view of the
same bytes and is viewed back on import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import warnings

import numpy as np
import torch


@dataclass(frozen=True)
class KVMeta:
    model_id: str  # fingerprint of the model's config and weights (engine/execution/loader.py)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int  # tokens before the next one: the prompt, and a resumed request's earlier output
    start: int = 0  # the payload holds tokens [start, num_tokens); D must hold the ones before in its cache


@dataclass
class KVPayload:
    meta: KVMeta
    # [layers, 2 (k, v), num_tokens - start, kv_heads, head_dim]; None while the bytes travel on their own
    # (deployments/replicas/servers.py sends them through Ray's object store, apart from the metadata).
    data: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class KVMismatchError(ValueError):
    """Imported KV does not fit this engine's model; the message names the field."""


def tensor_to_numpy(kv: torch.Tensor) -> np.ndarray:
    """[L, 2, T, H, D] tensor (any device) as a numpy array, bf16 as int16 bits."""
    kv = kv.detach().to("cpu").contiguous()
    if kv.dtype == torch.bfloat16:
        return kv.view(torch.int16).numpy()
    return kv.numpy()


def numpy_to_tensor(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``data``'s memory. Arrays from Ray's object store are read-only; the
    engine only reads them (to copy into its pool), so torch's warning about that is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(np.ascontiguousarray(data))
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def check_compatible(meta: KVMeta, expected: KVMeta, num_tokens: int) -> None:
    """Raise KVMismatchError naming the first field where ``meta`` differs from this engine."""
    for name, value in asdict(expected).items():
        if name not in ("num_tokens", "start") and getattr(meta, name) != value:
            raise KVMismatchError(f"kv.{name}: got {getattr(meta, name)!r}, this engine has {value!r}")
    if meta.num_tokens != num_tokens:
        raise KVMismatchError(f"kv.num_tokens: got {meta.num_tokens}, the request has {num_tokens} tokens "
                              "before its next one")
    if not 0 <= meta.start < meta.num_tokens:
        raise KVMismatchError(f"kv.start: got {meta.start}, must be in [0, {meta.num_tokens})")
