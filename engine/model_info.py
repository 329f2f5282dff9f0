"""What a served model is, as plain data: what the ingress and the dialects read about the engine
behind a deployment (its limits, dtype, ids). Below both the Serve room (deployments/replicas/servers.py
fills it in) and the dialects (dialects/openapi_doc.py writes its limits into the schema)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelInfo:
    """What the ingress needs to know about the engine behind a deployment."""

    model_path: str
    model_id: str
    vocab_size: int
    max_model_len: int
    max_iter_times: int
    node_id: str
    dtype: str
    enable_prefix_caching: bool
    pad_token_id: int  # the tokenizer's pad id, else the first end id: beam search's default pad_id
    hidden_size: int  # a p-tuning table's row length
    attention_backend: str  # engine/execution/attention/: the backend the engine runs
    batch_invariant: bool  # each request's output independent of its batch and chunking (docs/sampling.md)
    sampler_backend: str = "native"  # sampling/sampler.py: "ascend" (the NPU operator) or "native"
    # How the weights are held (engine/execution/loader.py LoadedModel.weight_storage): the dtype's
    # name, or "gguf:Q4_1+Q8_0" / "int8:Q8_0" for the block types kept quantized; /v1/models shows it.
    weight_storage: str = ""
