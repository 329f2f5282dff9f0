from engine.execution.attention.torch_sdpa import AttentionBatch, PrefillChunk, build_attention_batch, paged_attention

__all__ = ["AttentionBatch", "PrefillChunk", "build_attention_batch", "paged_attention"]
