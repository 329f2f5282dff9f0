"""Engine settings: one dataclass, filled from YAML or builder arguments.

Each setting is declared once, here: its default, what it means and its range (``setting``). The
app's arguments (deployments/config.py: AppArgs) are made from these fields, so a setting's
default, description and bounds have this one owner; ``__post_init__`` checks the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
QUANTIZATIONS = (None, "dequantize", "int8")  # engine/execution/quant/; docs/serving.md
ATTENTION_BACKENDS = ("auto", "torch_sdpa", "cpu_paged", "triton_paged")  # engine/execution/attention/


def setting(default, doc: str, *, ge: float | None = None, gt: float | None = None, choices: tuple | None = None,
            app: bool = True):
    """A field of EngineConfig: its default, what it means, its range (``ge``/``gt`` for numbers,
    unchecked when None; ``choices``), and whether it is an application argument too (``app``)."""
    return field(default=default, metadata={"doc": doc, "ge": ge, "gt": gt, "choices": choices, "app": app})


@dataclass
class EngineConfig:
    model: str = setting("tiny-llama", "a local Hugging Face model directory, or tiny-llama", app=False)
    dtype: str = setting("auto", "one of " + ", ".join(DTYPES) + "; auto: bfloat16 where the hardware computes it "
                         "natively (engine/execution/loader.py), else float32; float64 for exact parity tests",
                         choices=DTYPES)
    device: str = setting("cpu", "cpu, cuda[:N] or npu[:N]")
    quantization: str | None = setting(
        None, "unset: weights as the checkpoint stores them (a GGUF's quantized types kept, on the CPU and CUDA, "
        "where a kernel exists: engine/execution/quant/), the rest in dtype; dequantize: every weight in dtype; "
        "int8: a Hugging Face checkpoint's linear weights and embeddings in int8 (quant/int8.py), CPU and CUDA",
        choices=QUANTIZATIONS)
    block_size: int = setting(16, "tokens per KV block", ge=1)
    num_blocks: int | None = setting(None, "KV pool size in blocks; unset: from kv_cache_memory_gb", ge=1)
    kv_cache_memory_gb: float = setting(0.5, "the KV pool's size when num_blocks is unset (GB)", gt=0)
    max_num_seqs: int = setting(256, "requests in one step at most", ge=1)
    max_num_batched_tokens: int = setting(2048, "tokens in one step at most (prefill chunks + decodes)", ge=1)
    max_model_len: int | None = setting(None, "prompt + output at most; unset: the model's max_position_embeddings",
                                        ge=1)
    max_iter_times: int = setting(1024, "server cap on generated tokens per request (MindIE's maxIterTimes)", ge=1)
    # The dialects' served default is this one (dialects/serving_fields.py); every served request brings a deadline.
    default_timeout_s: float = setting(600.0, "deadline for requests that bring none", gt=0, app=False)
    top_k_guess: int = setting(32, "candidates tried first for top-p (the Ascend operator's topKGuess)", ge=1)
    sampler_backend: str = setting("auto", "auto (Ascend's operator on an NPU, else torch), native or ascend "
                                   "(checked by sampling/sampler.py)")
    torch_threads: int | None = setting(None, "intra-op threads per engine replica; unset: torch's default", ge=1)
    enable_prefix_caching: bool = setting(True, "reuse the KV of full prompt blocks other requests computed")
    kv_tier_gb: float = setting(0.0, "the second KV tier's size (GB; engine/kv_tier.py): reused blocks the prefix "
                                "cache evicts are kept there and copied back on a hit instead of computed again; a "
                                "memory-mapped file behind a CPU pool, pinned host memory behind a CUDA pool. 0: "
                                "off (docs/serving.md, \"The second KV tier\": where it pays)", ge=0)
    kv_tier_dir: str | None = setting(None, "the directory of the tier's memory-mapped file behind a CPU pool; "
                                      "unset: the system's temporary directory")
    attention_backend: str = setting(
        "auto", "auto, torch_sdpa (the reference), cpu_paged (the C++ kernel that reads the KV pool in place, CPU) "
        "or triton_paged (the Triton kernels, CUDA); engine/execution/attention/", choices=ATTENTION_BACKENDS)
    batch_invariant: bool | None = setting(
        None, "each request's tokens and logprobs independent of the other requests of its steps and of its "
        "prompt's chunking, in float32, bfloat16 and float16 on the CPU (docs/sampling.md); costs some throughput. "
        "Unset: PDSERVE_BATCH_INVARIANT=1 or 0 in the replicas' environment decides, else on on the CPU, but in "
        "fp16, and in bf16 with weights kept quantized, on a CPU with AMX or AVX512-BF16 "
        "(attention.batch_invariant_by_default)")
    enforce_eager: bool = setting(False, "CUDA with triton_paged: capture no CUDA graph (vLLM's setting of the "
                                  "same name); elsewhere every step runs eagerly")
    max_cuda_graph_batch: int = setting(256, "CUDA with triton_paged: decode steps of up to this many rows replay "
                                        "CUDA graphs captured at start-up (engine/execution/cuda_graphs.py); "
                                        "0 captures none", ge=0)
    max_draft_tokens: int = setting(8, "speculative decoding (engine/decoding/speculative.py): the most draft "
                                    "tokens a request may send (TensorRT-LLM's max_draft_len, /infer_token's "
                                    "draft_input_ids), all verified in one step; 0 refuses drafts", ge=0)
    prompt_lookup: bool = setting(False, "speculative decoding by prompt lookup for requests that do not say "
                                  "(docs/serving.md); the output is the same either way")
    num_speculative_tokens: int = setting(4, "prompt lookup: drafts per step", ge=1)
    prompt_lookup_min: int = setting(2, "prompt lookup: the shortest n-gram matched", ge=1)
    prompt_lookup_max: int = setting(4, "prompt lookup: the longest n-gram, tried first", ge=1)
    max_lora_rank: int = setting(16, "the largest LoRA rank an adapter may have (engine/lora_adapter.py)", ge=1)
    # D in PD: max_iter_times counts the tokens after the first, which P makes, or this engine in
    # P's place when it prefills a request locally (deployments/pd/disaggregation.py): the same cap either way.
    first_token_from_prefill: bool = setting(False, "D in PD: P makes each request's first token", app=False)

    def __post_init__(self) -> None:
        for spec in fields(self):
            value, bounds = getattr(self, spec.name), spec.metadata
            if bounds["choices"] is not None and value not in bounds["choices"]:
                raise ValueError(f"{spec.name}: must be one of {', '.join(map(str, bounds['choices']))}, got {value!r}")
            if value is None or isinstance(value, (bool, str)):
                continue
            if bounds["ge"] is not None and value < bounds["ge"]:
                raise ValueError(f"{spec.name}: must be >= {bounds['ge']}")
            if bounds["gt"] is not None and value <= bounds["gt"]:
                raise ValueError(f"{spec.name}: must be > {bounds['gt']}")
        if self.batch_invariant and self.attention_backend == "torch_sdpa":
            raise ValueError("batch_invariant: needs the cpu_paged attention (a fixed order over keys); "
                             "torch_sdpa's order depends on the chunking")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("prompt_lookup_max: must be >= prompt_lookup_min")


def app_settings() -> list:
    """The fields of EngineConfig that are application arguments too (deployments/config.py)."""
    return [spec for spec in fields(EngineConfig) if spec.metadata["app"]]
