"""Tiny random Hugging Face models of each supported architecture, made inside the tests."""

from __future__ import annotations

import json
from pathlib import Path
import shutil

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

from engine.execution.tiny_model import ensure_tiny_model

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)

ARCHITECTURES = {
    "llama": lambda vocab: LlamaConfig(vocab_size=vocab, **COMMON),
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, **COMMON),
    "qwen3": lambda vocab: Qwen3Config(vocab_size=vocab, head_dim=32, **COMMON),
    # A window shorter than the prompts, so the sliding-window masks are exercised.
    "mistral": lambda vocab: MistralConfig(vocab_size=vocab, sliding_window=24, **COMMON),
}


def llama_head_128(vocab: int) -> LlamaConfig:
    """Llama 3's attention shape at tiny width: heads of 128 (wider than the hidden size), GQA 4."""
    return LlamaConfig(vocab_size=vocab, **{**COMMON, "num_key_value_heads": 1}, head_dim=128)


def make_random_model(directory: Path, architecture: str, seed: int = 0, vocab_size: int | None = None,
                      make_config=None) -> Path:
    """A random model of ``architecture`` with tiny-llama's tokenizer, saved to ``directory``.
    ``vocab_size`` larger than the tokenizer's gives ids that decode to no text; ``make_config``
    (vocab -> a transformers config) replaces ARCHITECTURES' for a shape of the test's own."""
    tokenizer_dir = ensure_tiny_model()
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    vocab = vocab_size or len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    config = (make_config or ARCHITECTURES[architecture])(vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the default init: sharper, less tied logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(directory)
    return directory


def load_hf(directory: Path, dtype: torch.dtype = torch.float64):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
