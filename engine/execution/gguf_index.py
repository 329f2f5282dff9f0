"""A GGUF file's tensor table, read without parsing its metadata.

The gguf package's ``GGUFReader`` builds a numpy view of every metadata value on open: for a
file with a tokenizer inside (SmolLM2's 49,152 tokens and 48,900 merges) that is ~150,000
fields and 3 to 6 s of Python at every replica's start. The quantized loader needs only the
architecture's name and the tensor table, so this reads the header, steps over the metadata by
its lengths alone (one ``struct`` read per string) and maps the tensors' bytes from the file.
The layout is GGUF v2/v3's (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
header, metadata key/values, tensor infos, padding to ``general.alignment``, tensor data.
``tests/test_gguf.py`` checks it against ``GGUFReader`` on the same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from pathlib import Path
import struct

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
import numpy as np

MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# Metadata value types of fixed size -> (struct format, bytes).
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
           7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # read-only view of the file: [rows, row bytes] uint8 for block types, [rows, cols] else


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str | None
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Reads little-endian values from the mapped file at a moving offset."""

    def __init__(self, buffer: np.memmap) -> None:
        self.buffer, self.offset = buffer, 0

    def read(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.read("Q")
        self.offset += length
        return bytes(self.buffer[self.offset - length:self.offset]).decode("utf-8")

    def skip_value(self, value_type: int) -> None:
        if value_type == STRING:
            length = self.read("Q")  # read first: `offset += read()` would add to the offset before the read
            self.offset += length
        elif value_type == ARRAY:
            item_type, count = self.read("I"), self.read("Q")
            if item_type in SCALARS:
                self.offset += count * SCALARS[item_type][1]
            else:  # strings (or nested arrays): each carries its own length
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            self.offset += SCALARS[value_type][1]


def read_tensor_index(path: Path) -> GGUFIndex:
    """The architecture (``general.architecture``) and every tensor of GGUF ``path``, its bytes a
    read-only view of the file (no copy)."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    magic, version = cursor.read("I"), cursor.read("I")
    if magic != MAGIC or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF v2/v3 file (magic {magic:#x}, version {version})")
    tensor_count, kv_count = cursor.read("Q"), cursor.read("Q")
    architecture, alignment = None, DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.read("I")
        if key == "general.architecture" and value_type == STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and value_type in SCALARS:
            alignment = cursor.read(SCALARS[value_type][0])
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(tensor_count):
        name, n_dims = cursor.string(), cursor.read("I")
        dims = [cursor.read("Q") for _ in range(n_dims)]  # ggml order: the fastest-varying first
        infos.append((name, dims, GGMLQuantizationType(cursor.read("I")), cursor.read("Q")))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, tensor_type, offset in infos:
        block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
        row_bytes = dims[0] // block_size * block_bytes
        rows = prod(dims[1:])
        start = data_start + offset
        raw = buffer[start:start + rows * row_bytes].reshape(rows, row_bytes)
        if block_size == 1:  # plain floats / ints: the element type, as GGUFReader gives them
            raw = raw.view(_PLAIN_DTYPES[tensor_type])
        tensors[name] = GGUFTensor(name, tensor_type, raw)
    return GGUFIndex(architecture, tensors)


_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64, GGMLQuantizationType.BF16: np.uint16}
