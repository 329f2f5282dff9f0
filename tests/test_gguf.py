"""GGUF as a model source, without the real model: which paths name a GGUF, refusals that name the
unreadable architecture or tensor types, and the cache keyed by the file's digest and the dtype.
(tests/test_real_model.py serves the real GGUF.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.execution import gguf as gguf_source
from engine.execution.gguf_index import read_tensor_index
from engine.execution.loader import resolve_model_dir


def write_gguf(path: Path, architecture: str = "llama", tensor_types=(gguf.GGMLQuantizationType.F32,)) -> Path:
    """A GGUF file with a header and one [2, 256] tensor per type (zero bytes, 256 values a row: a
    whole number of blocks for every type)."""
    writer = gguf.GGUFWriter(path, architecture)
    for i, quant_type in enumerate(tensor_types):
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
        data = np.zeros((2, 256 // block_values * block_bytes), dtype=np.uint8)  # [rows, bytes per row]
        writer.add_tensor(f"blk.{i}.ffn_down.weight", data, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_find_gguf_takes_a_file_or_a_directory_holding_exactly_one(tmp_path):
    (tmp_path / "one").mkdir()
    file = write_gguf(tmp_path / "one" / "m.Q8_0.gguf")
    assert gguf_source.find_gguf(str(file)) == file
    assert gguf_source.find_gguf(str(tmp_path / "one")) == file
    assert gguf_source.find_gguf("tiny-llama") is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "extra.gguf").write_bytes(b"")
    assert gguf_source.find_gguf(str(tmp_path / "hf")) is None  # a Hugging Face directory stays one


def test_a_directory_with_two_gguf_files_is_refused_naming_them(tmp_path):
    write_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"model: .*2 GGUF files \(a\.gguf, b\.gguf\)"):
        resolve_model_dir(str(tmp_path))


def test_a_missing_gguf_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model: GGUF file .*missing.gguf.* does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))


def test_an_architecture_pdserve_does_not_run_is_refused_naming_it(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; supported: llama, qwen2"):
        gguf_source.check_readable(path)


def test_tensor_types_the_gguf_package_cannot_read_are_refused_naming_them(tmp_path):
    types = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_1, gguf.GGMLQuantizationType.Q8_K)
    path = write_gguf(tmp_path / "m.gguf", tensor_types=types)
    with pytest.raises(ValueError, match=r"GGUF tensor types Q8_1, Q8_K cannot be dequantized"):
        gguf_source.check_readable(path)


def test_readable_types_pass(tmp_path):
    types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q4_1,
             gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q8_0)
    gguf_source.check_readable(write_gguf(tmp_path / "m.gguf", tensor_types=types))


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        gguf_source.check_readable(path)


def test_the_cache_converts_once_per_file_digest_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    conversions = []

    def fake_convert(path, dtype, directory, digest):  # the real conversion is tests/test_real_model.py's
        conversions.append((path.read_bytes(), dtype))
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_source, "convert", fake_convert)
    path = write_gguf(tmp_path / "m.gguf")
    first = gguf_source.cached_model_dir(path, torch.float32)
    assert gguf_source.cached_model_dir(path, torch.float32) == first
    assert len(conversions) == 1
    assert first.parent == tmp_path / "cache" / "gguf" and (first / "config.json").is_file()
    assert gguf_source.cached_model_dir(path, torch.bfloat16) != first  # another dtype, another copy
    write_gguf(path, tensor_types=(gguf.GGMLQuantizationType.F16,))  # same name, other bytes
    assert gguf_source.cached_model_dir(path, torch.float32) != first
    assert len(conversions) == 3
    assert not [p for p in first.parent.iterdir() if p.is_dir() and p.name.startswith(".")]  # no staging left


def test_a_failed_conversion_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    def failing_convert(path, dtype, directory, digest):
        (directory / "model.safetensors").write_bytes(b"half")
        raise ValueError("model: conversion failed")

    monkeypatch.setattr(gguf_source, "convert", failing_convert)
    with pytest.raises(ValueError, match="conversion failed"):
        gguf_source.cached_model_dir(write_gguf(tmp_path / "m.gguf"), torch.float32)
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()]


@pytest.mark.parametrize("alignment", [32, 64])
def test_the_tensor_index_reads_what_the_gguf_package_reads(tmp_path, alignment):
    """engine/execution/gguf_index.py steps over the metadata (strings, arrays of strings and of
    numbers, every scalar type) by its lengths: its tensors (names, types, bytes) and architecture
    equal GGUFReader's, past a tokenizer-like table and a custom alignment."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen2")
    writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}é" for i in range(300)])
    writer.add_array("tokenizer.ggml.token_type", list(range(300)))
    writer.add_array("tokenizer.ggml.scores", [0.5] * 7)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_float64("x.f64", 1.5)
    writer.add_int64("x.i64", -3)
    writer.add_uint16("x.u16", 7)
    writer.add_string("tokenizer.chat_template", "{{ messages }}" * 50)
    types = [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0,
             gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K]
    for i, quant_type in enumerate(types):
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
        rows = 3 + i
        data = rng.integers(0, 256, (rows, 512 // block_values * block_bytes), dtype=np.uint8)
        writer.add_tensor(f"blk.{i}.w", data, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    index = read_tensor_index(tmp_path / "m.gguf")
    assert index.architecture == reader.fields["general.architecture"].contents() == "qwen2"
    assert list(index.tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        mine = index.tensors[tensor.name]
        expected = np.asarray(tensor.data)
        assert mine.tensor_type == tensor.tensor_type and mine.data.dtype == expected.dtype
        assert mine.data.shape[0] == expected.reshape(mine.data.shape[0], -1).shape[0]
        assert mine.data.tobytes() == expected.tobytes()  # bytes: random F32/F16 bits hold NaNs
