"""Model loading: a Hugging Face causal-LM directory -> DecoderModel, tokenizer, metadata.

Reads config.json through AutoConfig, the tokenizer through AutoTokenizer and the weights
from *.safetensors; nothing is downloaded. "tiny-llama" names the embedded default model,
made on first use (engine/execution/tiny_model.py); a .gguf file's config, tokenizer, norms and
biases come from its dequantized copy (engine/execution/gguf.py), and on the CPU and CUDA its
linear weights stay in their stored types where a kernel exists (engine/execution/quant/).
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import importlib.util
import json
import logging
from pathlib import Path

from safetensors import safe_open
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import EngineConfig
from engine.execution.gguf import cached_model_dir, find_gguf
from engine.execution.model import DecoderModel, ModelSpec
from engine.execution.quant import kernels as quant_kernels
from engine.execution.quant.int8 import quantize_to_int8
from engine.execution.quant.linear import QuantizedLinear

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
TINY_LLAMA = "tiny-llama"


@dataclass
class LoadedModel:
    path: Path
    model: DecoderModel
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    model_id: str  # fingerprint that P and D compare before KV moves between them
    eos_token_ids: list[int]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    # How the weights are held: the dtype's name, or the block types kept quantized ("gguf:Q4_1+Q8_0",
    # "int8:Q8_0"), with the dtype for the rest; /v1/models shows it (engine/model_info.py).
    weight_storage: str = ""
    weight_bytes: int = 0  # the model's resident parameters and quantized blocks, in bytes


def resolve_model_dir(name: str, dtype: torch.dtype | None = None) -> Path:
    """A local directory, "tiny-llama", a GGUF file (or a directory holding one), or a hub id already
    in the local Hugging Face cache. A GGUF is served from its dequantized copy in ``dtype``
    (default: what "auto" is on the CPU), made on first use (engine/execution/gguf.py)."""
    if name == TINY_LLAMA:
        from engine.execution.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    gguf_file = find_gguf(name)
    if gguf_file is not None:
        return cached_model_dir(gguf_file, dtype or torch_dtype("auto"))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {path} has no config.json; pass a Hugging Face model directory")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        raise ValueError(
            f"model: {name!r} is neither a local directory nor in the local Hugging Face cache, and pdserve "
            "never downloads; pass a local model directory (config.json, *.safetensors, tokenizer files), "
            f"a .gguf file or {TINY_LLAMA!r}") from None


def torch_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """The dtype named, or for "auto" bfloat16 where ``device`` computes it natively, else float32."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if native_bf16(device or torch.device("cpu")) else torch.float32


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively: AMX or AVX512-BF16 on an x86 CPU (without them torch
    emulates bf16, slower than float32), bf16 support on a GPU or NPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "npu":
        return bool(getattr(torch.npu, "is_bf16_supported", lambda: False)())
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_device(name: str) -> torch.device:
    if name.startswith("npu"):
        importlib.import_module("torch_npu")  # registers the npu device with torch
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    return device


def load_model(config: EngineConfig) -> LoadedModel:
    device = resolve_device(config.device)
    dtype = torch_dtype(config.dtype, device)
    if config.quantization == "int8":
        _check_int8(config, device)
    path = resolve_model_dir(config.model, dtype)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    spec = model_spec(hf_config)
    model = DecoderModel(spec)
    quantized = _quantized_modules(config, spec, dtype, device)
    for name, module in quantized.items():  # before the state dict: their weights are not read from it
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, module)
    model.load_state_dict(_fused_state_dict(path, spec, skip=quantized.keys()), strict=True)
    if config.quantization == "int8":
        quantize_to_int8(model, dtype)  # from the checkpoint's own values, before the cast to dtype
    model.to(device=device, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    max_model_len = min(config.max_model_len or spec.max_position, spec.max_position)
    storage = weight_storage(model, dtype, "int8" if config.quantization == "int8" else "gguf")
    model_id = model_fingerprint(path)
    if storage != str(dtype).removeprefix("torch."):  # other weights than the checkpoint's: P and D must not mix KV
        model_id = hashlib.sha256(f"{model_id}:{storage}".encode()).hexdigest()[:16]
        logger.info("model %s: weights %s, %.1f MB resident", config.model, storage, resident_bytes(model) / 1e6)
    return LoadedModel(path, model, tokenizer, spec, model_id, _eos_ids(path, hf_config, tokenizer),
                       max_model_len, dtype, device, storage, resident_bytes(model))


def _quantized_modules(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> dict:
    """A GGUF's linear weights kept in their stored types (engine/execution/quant/gguf_tensors.py),
    where kernels multiply them (quantized_kernels), below float64, with ``quantization`` not
    "dequantize"; else none. The log says which kernels."""
    gguf_file = find_gguf(config.model)
    if gguf_file is None or config.quantization == "dequantize":
        return {}
    kernels = quantized_kernels(device)
    if kernels is None or dtype == torch.float64:  # float64 is for exact parity: the kernels sum in float32
        logger.warning("GGUF %s: no quantized kernels on %s in %s; serving its weights dequantized",
                       gguf_file.name, device, dtype)
        return {}
    from engine.execution.quant.gguf_tensors import quantized_modules

    logger.info("GGUF %s: weights kept in their stored types where a kernel exists, multiplied by the %s kernels "
                "on %s", gguf_file.name, kernels, device)
    return quantized_modules(gguf_file, spec, dtype)


def quantized_kernels(device: torch.device) -> str | None:
    """Which kernels multiply quantized blocks on ``device``: "C++" on the CPU (quant/kernels.py, where
    they build), "Triton" on CUDA (quant/triton_linear.py, where triton is installed); None elsewhere."""
    if device.type == "cpu":
        return "C++" if quant_kernels.available() else None
    if device.type == "cuda":
        return "Triton" if importlib.util.find_spec("triton") is not None else None
    return None


def weight_storage(model: DecoderModel, dtype: torch.dtype, kind: str = "gguf") -> str:
    """"<kind>:<block types kept quantized>" (``dtype`` for the rest), e.g. "gguf:Q4_1+Q8_0" or
    "int8:Q8_0", or ``dtype``'s name when no weight is quantized."""
    types = set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            types.update(t.name for t in module.types)
    name = str(dtype).removeprefix("torch.")
    return f"{kind}:{'+'.join(sorted(types))}" if types else name


def _check_int8(config: EngineConfig, device: torch.device) -> None:
    """Refuse int8 where it cannot run, naming the field."""
    if find_gguf(config.model) is not None:
        raise ValueError("quantization: int8 is for Hugging Face checkpoints; a GGUF keeps its own types "
                         "(leave quantization unset) or is dequantized (quantization: dequantize)")
    if quantized_kernels(device) is None:
        raise ValueError(f"quantization: int8 runs on the quantized kernels (C++ on the CPU, Triton on CUDA), "
                         f"not on {device}")


def resident_bytes(model: DecoderModel) -> int:
    """Bytes of every parameter and buffer of ``model`` (quantized blocks included)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # a tied tensor once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def model_spec(hf_config) -> ModelSpec:
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: architecture {model_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("model: dynamic RoPE scaling depends on the sequence length and is not supported")
    if rope_type == "default":
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    else:  # Mistral: one window, if any, for every layer
        windows = [window] * num_layers
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelSpec(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=num_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=model_type == "qwen2" or bias,
        o_bias=bias and model_type != "qwen3",
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        layer_windows=windows,
        inv_freq=inv_freq.to(torch.float32),
        rope_scaling=float(scaling),
        max_position=hf_config.max_position_embeddings,
    )


def _fused_state_dict(path: Path, spec: ModelSpec, skip=()) -> dict[str, torch.Tensor]:
    """Read transformers' parameter names and fuse q/k/v and gate/up per layer; the weights of the
    modules in ``skip`` (kept quantized, engine/execution/quant/) are left out."""
    raw: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {path} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                raw[key.removeprefix("model.")] = f.get_tensor(key)
    state = {"embed_tokens.weight": raw["embed_tokens.weight"], "norm.weight": raw["norm.weight"]}
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = raw["lm_head.weight"]
    for i in range(spec.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        state[dst + "input_norm.weight"] = raw[src + "input_layernorm.weight"]
        state[dst + "post_norm.weight"] = raw[src + "post_attention_layernorm.weight"]
        state[dst + "qkv_proj.weight"] = torch.cat([raw[attn + f"{p}_proj.weight"] for p in "qkv"])
        if spec.qkv_bias:
            state[dst + "qkv_proj.bias"] = torch.cat([raw[attn + f"{p}_proj.bias"] for p in "qkv"])
        state[dst + "o_proj.weight"] = raw[attn + "o_proj.weight"]
        if spec.o_bias:
            state[dst + "o_proj.bias"] = raw[attn + "o_proj.bias"]
        if spec.qk_norm:
            state[dst + "q_norm.weight"] = raw[attn + "q_norm.weight"]
            state[dst + "k_norm.weight"] = raw[attn + "k_norm.weight"]
        state[dst + "gate_up_proj.weight"] = torch.cat([raw[mlp + "gate_proj.weight"], raw[mlp + "up_proj.weight"]])
        state[dst + "down_proj.weight"] = raw[mlp + "down_proj.weight"]
        if spec.mlp_bias:
            state[dst + "gate_up_proj.bias"] = torch.cat([raw[mlp + "gate_proj.bias"], raw[mlp + "up_proj.bias"]])
            state[dst + "down_proj.bias"] = raw[mlp + "down_proj.bias"]
    return {key: tensor for key, tensor in state.items() if key.removesuffix(".weight") not in skip}


def model_fingerprint(path: Path) -> str:
    """sha256 over config.json and each weight file's size, head and tail (1 MiB each):
    cheap to compute on every replica, and different for models that differ in config or weights."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as f:
            digest.update(str(size).encode())
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _eos_ids(path: Path, hf_config, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    candidates = None
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        candidates = json.loads(gen_file.read_text()).get("eos_token_id")
    if candidates is None:
        candidates = getattr(hf_config, "eos_token_id", None)
    if candidates is None:
        candidates = tokenizer.eos_token_id
    if candidates is None:
        return []
    return list(candidates) if isinstance(candidates, (list, tuple)) else [candidates]
