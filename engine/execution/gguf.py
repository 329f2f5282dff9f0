"""GGUF checkpoints (llama.cpp's single-file format) as a model source.

A ``.gguf`` file, or a directory holding exactly one, is dequantized once to the serving dtype by
transformers' GGUF reader and cached as an ordinary Hugging Face model directory (config.json,
model.safetensors, tokenizer files with the file's own chat template, generation_config.json),
keyed by the file's sha256 and the dtype. Every later start, P and D and each replica, loads that
directory as it loads any other. Where quantized kernels run (the CPU's C++ ones, Triton's on
CUDA), the linear weights and the token table are then taken from the file's own blocks instead
(engine/execution/quant/gguf_tensors.py) and only the rest (norms, biases, types without a
kernel) from this directory (docs/serving.md, "Weights: dtype and quantization").

The cache lives in ``$PDSERVE_CACHE/gguf`` (default ``~/.cache/pdserve/gguf``), one directory per
(file, dtype) of about parameters x dtype size (SmolLM2-135M: 540 MB in float32, 270 MB in
bfloat16); deleting it is safe at any time when no server is starting.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from pathlib import Path
import shutil
import tempfile

import torch

from engine.execution.tiny_model import cache_root

SUFFIX = ".gguf"
CACHE_FORMAT = 1  # bump when the cached directory's layout changes: old entries are then ignored
# GGUF architecture names pdserve's DecoderModel runs (loader.SUPPORTED_MODEL_TYPES, as GGUF spells them).
SERVED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def find_gguf(name: str) -> Path | None:
    """The GGUF file ``name`` designates: a ``.gguf`` file, or a directory without config.json
    holding exactly one; None for anything else (a Hugging Face directory, tiny-llama, a hub id)."""
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == SUFFIX:
        return path.resolve()
    if path.suffix == SUFFIX and not path.exists():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise ValueError(f"model: {path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                         "pass one file")
    return files[0].resolve() if files else None


def file_digest(path: Path) -> str:
    """sha256 of the whole file (about 0.2 s per 100 MB): the cache key, so an edited file is converted again."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cached_model_dir(path: Path, dtype: torch.dtype) -> Path:
    """The ordinary model directory for GGUF ``path`` in ``dtype``, converted now if not cached yet.
    Concurrent starts (P and D, replicas) wait on one lock: one converts, the others find it made."""
    digest = file_digest(path)
    target = cache_root() / "gguf" / f"{path.stem}-{digest[:16]}-{_name(dtype)}-v{CACHE_FORMAT}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if not (target / "config.json").is_file():
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            try:
                convert(path, dtype, staging, digest)
                staging.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary directory
                staging.rename(target)  # whole or absent: a start that dies mid-way leaves no half directory
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _locked(lock_file: Path):
    with lock_file.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_readable(path: Path) -> None:
    """Refuse, naming them, an architecture pdserve does not run or tensor types the gguf package
    cannot dequantize; reads the header and tensor table only (no weights)."""
    from gguf import GGML_QUANT_SIZES, GGUFReader
    from gguf.quants import dequantize
    import numpy as np

    try:
        reader = GGUFReader(path)
    except Exception as error:
        raise ValueError(f"model: {path} is not a readable GGUF file ({error})") from None
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture not in SERVED_ARCHITECTURES:
        raise ValueError(f"model: {path.name}: GGUF architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SERVED_ARCHITECTURES)}")
    unreadable = set()
    for quant_type in {tensor.tensor_type for tensor in reader.tensors}:
        block_bytes = GGML_QUANT_SIZES[quant_type][1]
        try:  # one block of zeros: the gguf package raises NotImplementedError for a type it cannot read
            dequantize(np.zeros(block_bytes, dtype=np.uint8), quant_type)
        except NotImplementedError:
            unreadable.add(quant_type.name)
    if unreadable:
        raise ValueError(f"model: {path.name}: GGUF tensor types {', '.join(sorted(unreadable))} cannot be "
                         "dequantized (the gguf package does not read them); convert the file with llama.cpp "
                         "to another type, e.g. Q8_0 or F16")


def convert(path: Path, dtype: torch.dtype, directory: Path, digest: str) -> None:
    """Write GGUF ``path`` to ``directory`` as a Hugging Face model directory in ``dtype``.

    transformers loads the file (dequantizing each tensor to float32, then casting) but refuses to
    save a GGUF-loaded model, so its state dict is saved with safetensors and its config without
    the quantization entry: the directory loads in transformers as in pdserve."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_readable(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's own tensor; safetensors refuses shared storage
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "gguf_source.json").write_text(json.dumps(
        {"file": str(path), "sha256": digest, "dtype": _name(dtype)}, indent=1))
