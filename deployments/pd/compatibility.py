"""What a replica's KV means, and which P and D replicas may exchange it (docs/serving.md, "Compatible pairs").

Each P and D replica states, once at start, what its KV means (``KVDescriptor``): the model (its
name and a digest of its config and weights), the compute dtype, the KV pool's dtype, a digest of
the tokenizer's files, the block size, layers x KV heads x head size, the longest context, the
draft settings and the LoRA settings. It sends the statement with every answer to the ingress's
probe (deployments/pd/decode_watch.py). A P and a D whose statements differ in any field are never
paired: KV made under one would be read under another meaning (vLLM's NIXL connector refuses such a
pair at its handshake; llm-d's users saw such pairs hang). No difference is converted today.

``pair`` picks, among the statements both a P and a D replica make, the one most replicas make; the
replicas that make another are *unpaired*: the routers skip them and ``/health`` names each with the
fields it differs in. When no statement is shared by a P and a D, every D replica is unpaired and the
app serves on P alone (``pd_degrade_to_prefill``), or refuses with a 503 naming "incompatible
prefill/decode".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
import hashlib
from pathlib import Path

INCOMPATIBLE = "incompatible prefill/decode"
# The files that define a Hugging Face tokenizer (those of them a model directory has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja")


@dataclass(frozen=True)
class KVDescriptor:
    """What a replica's KV means; two replicas may exchange KV only when these are equal."""

    model: str  # the model's name as configured (a directory's or file's name, or tiny-llama)
    weights_digest: str  # config.json and a sample of the weights' bytes (engine/execution/loader.py)
    dtype: str  # the engine's compute dtype
    kv_dtype: str  # the KV pool's element type
    tokenizer_digest: str  # sha256 of the tokenizer's files (TOKENIZER_FILES)
    block_size: int  # tokens per KV block
    kv_shape: str  # "layers x KV heads x head size"
    max_context: int  # the longest prompt + output the model is configured for
    draft: str  # draft tokens a request may bring, and prompt lookup's drafts per step (0: off)
    lora: str  # "off", or the largest adapter rank taken


def tokenizer_digest(model_dir: Path) -> str:
    """sha256 over the tokenizer files ``model_dir`` holds, each with its name: small files,
    read once at a replica's start."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def describe(engine, lora_enabled: bool) -> KVDescriptor:
    """The descriptor of an LLMEngine (engine/llm_engine.py), read from its loaded model and config;
    ``lora_enabled``: the replica has the app's LoRA store."""
    loaded, config = engine.loaded, engine.config
    spec = loaded.spec
    drafts = config.num_speculative_tokens if config.prompt_lookup else 0
    return KVDescriptor(
        model=Path(config.model).name, weights_digest=loaded.model_id, dtype=engine.dtype,
        kv_dtype=str(engine.runner.kv_cache.dtype).removeprefix("torch."),
        tokenizer_digest=tokenizer_digest(Path(loaded.path)), block_size=config.block_size,
        kv_shape=f"{spec.num_layers} x {spec.num_kv_heads} x {spec.head_dim}", max_context=loaded.max_model_len,
        draft=f"max_draft_tokens {config.max_draft_tokens}, prompt lookup {drafts}",
        lora=f"rank <= {config.max_lora_rank}" if lora_enabled else "off")


def differences(first: KVDescriptor, second: KVDescriptor, names: tuple[str, str] = ("P", "D")) -> list[str]:
    """Each field where the two differ, as "field: P has x, D has y" (``names``: who has each)."""
    return [f"{f.name}: {names[0]} has {getattr(first, f.name)}, {names[1]} has {getattr(second, f.name)}"
            for f in fields(KVDescriptor) if getattr(first, f.name) != getattr(second, f.name)]


@dataclass
class Pairing:
    """Which replicas may exchange KV: ``unpaired`` maps each replica that may not (by role, then
    replica id) to why."""

    descriptor: KVDescriptor | None  # the one P and D replicas share (None: none is shared)
    unpaired: dict[str, dict[str, str]]  # "PrefillServer" / "DecodeServer" -> replica id -> reason

    def reasons(self) -> list[str]:
        """One line per unpaired replica, for /health and the log."""
        return [f"{role} {replica}: {reason}" for role, by_replica in self.unpaired.items()
                for replica, reason in sorted(by_replica.items())]


def pair(prefill: dict[str, KVDescriptor], decode: dict[str, KVDescriptor]) -> Pairing:
    """The pairing of the P and D replicas that stated their descriptors (replica id -> descriptor):
    the descriptor both roles state that the most replicas state (ties: the one most P replicas
    state, then the first in repr order); a replica stating another is unpaired. With none shared,
    every D replica is unpaired against P's most common descriptor, and no P replica is (P may
    serve alone)."""
    counts, by_p = Counter([*prefill.values(), *decode.values()]), Counter(prefill.values())
    shared = sorted(set(prefill.values()) & set(decode.values()), key=repr)
    chosen = max(shared, key=lambda d: (counts[d], by_p[d])) if shared else None
    unpaired: dict[str, dict[str, str]] = {}
    if chosen is not None:
        for replica, descriptor in prefill.items():
            if descriptor != chosen:
                why = differences(descriptor, chosen, ("this P", "the pairing"))
                unpaired.setdefault("PrefillServer", {})[replica] = f"{INCOMPATIBLE}: " + "; ".join(why)
    against = chosen or max(sorted(by_p, key=repr), key=lambda d: by_p[d], default=None)
    for replica, descriptor in decode.items():
        if against is not None and descriptor != against:
            unpaired.setdefault("DecodeServer", {})[replica] = (f"{INCOMPATIBLE}: "
                                                                + "; ".join(differences(against, descriptor)))
    return Pairing(chosen, unpaired)
