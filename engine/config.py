"""Engine settings: one dataclass, filled from YAML or builder arguments."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
QUANTIZATIONS = (None, "dequantize", "int8")  # engine/execution/quant/; docs/serving.md
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "cpu_paged", "triton_paged")  # engine/execution/attention/


@dataclass
class EngineConfig:
    model: str = "tiny-llama"  # a local Hugging Face model directory, or "tiny-llama"
    # auto: bfloat16 where the hardware has it (engine/execution/loader.py), else float32; float64 for exact parity tests
    dtype: str = "auto"
    device: str = "cpu"  # cpu, cuda[:N] or npu[:N]
    # None: weights as the checkpoint stores them - a GGUF's quantized types kept, on the CPU, where a
    # kernel exists (engine/execution/quant/), the rest in dtype; "dequantize": every weight in dtype;
    # "int8": a Hugging Face checkpoint's linear weights and embeddings in int8 (quant/int8.py), CPU only.
    quantization: str | None = None
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 0.5
    max_num_seqs: int = 256  # requests in one step at most
    max_num_batched_tokens: int = 2048  # tokens in one step at most (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output; None: the model's max_position_embeddings
    max_iter_times: int = 1024  # server cap on generated tokens per request (MindIE's maxIterTimes)
    default_timeout_s: float = 600.0  # deadline for requests that bring none
    top_k_guess: int = 32  # candidates tried first for top-p (the Ascend operator's topKGuess)
    sampler_backend: str = "auto"  # auto (Ascend's operator on an NPU, else torch), native, ascend
    torch_threads: int | None = None  # intra-op threads for this engine; None: torch's default
    enable_prefix_caching: bool = True  # reuse the KV of full blocks other requests computed
    # engine/execution/attention/: auto, torch_sdpa (the reference), cpu_paged (the C++ kernel, CPU) or
    # triton_paged (the Triton kernels, CUDA)
    attention_backend: str = "auto"
    # Each row's tokens and logprobs independent of the other rows of its step and of how its
    # prompt was chunked, in float32, bfloat16 and float16 on the CPU (docs/sampling.md); costs
    # some throughput (benchmarks/RESULTS.md). None: the environment's PDSERVE_BATCH_INVARIANT=1
    # (on wherever the engine can have it) or =0 (off), else the device's default: on on the CPU,
    # but in bf16/fp16 on a CPU that multiplies them natively (attention.batch_invariant_by_default).
    batch_invariant: bool | None = None
    # CUDA with triton_paged: decode steps of up to this many rows replay CUDA graphs captured at
    # start-up (engine/execution/cuda_graphs.py; larger steps run eagerly); enforce_eager captures
    # none (vLLM's setting of the same name). Elsewhere every step runs eagerly.
    enforce_eager: bool = False
    max_cuda_graph_batch: int = 256
    # Speculative decoding (engine/decoding/speculative.py): a request's own draft tokens, at most this many
    # (TensorRT-LLM's max_draft_len), all verified in one step.
    max_draft_tokens: int = 8
    prompt_lookup: bool = False  # draft by prompt lookup when a request does not say (its prompt_lookup)
    num_speculative_tokens: int = 4  # prompt lookup's drafts per step
    prompt_lookup_min: int = 2  # the shortest n-gram matched
    prompt_lookup_max: int = 4  # the longest, tried first
    max_lora_rank: int = 16  # the largest LoRA rank a request's adapter may have (engine/lora_adapter.py)
    # D in PD: max_iter_times counts the tokens after the first, which P makes, or this engine in
    # P's place when it prefills a request locally (deployments/pd/disaggregation.py): the same cap either way.
    first_token_from_prefill: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {', '.join(map(str, QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.batch_invariant and self.attention_backend == "torch_sdpa":
            raise ValueError("batch_invariant: needs the cpu_paged attention (a fixed order over keys); "
                             "torch_sdpa's order depends on the chunking")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_iter_times", "num_speculative_tokens",
                     "prompt_lookup_min", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.max_cuda_graph_batch < 0:
            raise ValueError("max_cuda_graph_batch: must be >= 0 (0 captures no graph)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        if self.max_draft_tokens < 0:
            raise ValueError("max_draft_tokens: must be >= 0 (0 refuses draft tokens)")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("prompt_lookup_max: must be >= prompt_lookup_min")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s: must be > 0")
