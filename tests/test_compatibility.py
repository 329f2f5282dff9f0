"""The P/D compatibility check (deployments/pd/compatibility.py), model-free: every field of the KV
descriptor a P and a D may differ in is named; the pairing keeps the descriptor most replicas
share and leaves the others unpaired; with none shared every D is unpaired and P is not; the
tokenizer digest follows the tokenizer's files and nothing else; a descriptor is read from an
engine's loaded model and config. The served check: tests/test_compatibility_served.py."""

import asyncio
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.request import GenerationRequest
from sampling.params import SamplingParams
from deployments.pd.compatibility import INCOMPATIBLE, KVDescriptor, describe, differences, pair, tokenizer_digest

BASE = KVDescriptor("tiny-llama", "w1", "float32", "float32", "t1", 16, "2 x 2 x 16", 2048,
                    "max_draft_tokens 8, prompt lookup 0", "off")
# The seven mismatches the issue injects, and the other fields: each a descriptor that differs in one.
MISMATCHES = {"block_size": 32, "dtype": "bfloat16", "kv_dtype": "float16", "tokenizer_digest": "t2",
              "model": "SmolLM2-135M", "weights_digest": "w2", "max_context": 4096,
              "draft": "max_draft_tokens 4, prompt lookup 0", "kv_shape": "2 x 4 x 16", "lora": "rank <= 16"}


def test_every_field_is_checked():
    assert set(MISMATCHES) == {f.name for f in fields(KVDescriptor)}


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_a_d_differing_in_one_field_is_never_paired_and_the_field_is_named(field):
    other = replace(BASE, **{field: MISMATCHES[field]})
    assert differences(BASE, other) == [f"{field}: P has {getattr(BASE, field)}, D has {MISMATCHES[field]}"]
    pairing = pair({"p1": BASE}, {"d1": BASE, "d2": other})
    assert pairing.descriptor == BASE
    assert pairing.unpaired == {"DecodeServer": {"d2": f"{INCOMPATIBLE}: {differences(BASE, other)[0]}"}}
    assert pairing.reasons() == [f"DecodeServer d2: {INCOMPATIBLE}: {differences(BASE, other)[0]}"]


def test_without_a_shared_descriptor_every_d_is_unpaired_and_no_p():
    other = replace(BASE, block_size=32, dtype="bfloat16")
    pairing = pair({"p1": BASE, "p2": BASE}, {"d1": other})
    assert pairing.descriptor is None
    assert pairing.unpaired == {"DecodeServer": {
        "d1": f"{INCOMPATIBLE}: dtype: P has float32, D has bfloat16; block_size: P has 16, D has 32"}}


def test_the_descriptor_most_replicas_share_is_kept_and_a_p_stating_another_is_unpaired():
    other = replace(BASE, max_context=4096)
    pairing = pair({"p1": BASE, "p2": other}, {"d1": BASE, "d2": BASE, "d3": other})
    assert pairing.descriptor == BASE  # 3 replicas state it, 2 the other
    assert set(pairing.unpaired["PrefillServer"]) == {"p2"}
    assert set(pairing.unpaired["DecodeServer"]) == {"d3"}
    assert "max_context: this P has 4096, the pairing has 2048" in pairing.unpaired["PrefillServer"]["p2"]


def test_nothing_is_unpaired_while_one_role_has_not_answered():
    assert pair({}, {"d1": BASE}).unpaired == {}
    assert pair({"p1": BASE}, {}).unpaired == {}


def test_the_tokenizer_digest_follows_the_tokenizers_files_only(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (tmp_path / "config.json").write_text("{}")
    first = tokenizer_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"other": 1}')  # not a tokenizer file
    assert tokenizer_digest(tmp_path) == first
    (tmp_path / "special_tokens_map.json").write_text("{}")
    assert tokenizer_digest(tmp_path) != first


def test_a_descriptor_is_read_from_the_engines_model_and_config(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text("{}")
    spec = SimpleNamespace(num_layers=2, num_kv_heads=4, head_dim=16)
    config = SimpleNamespace(model="/models/SmolLM2", block_size=32, prompt_lookup=True, num_speculative_tokens=4,
                             max_draft_tokens=8, max_lora_rank=16)
    engine = SimpleNamespace(loaded=SimpleNamespace(spec=spec, model_id="abc", path=tmp_path, max_model_len=8192),
                             config=config, dtype="bfloat16",
                             runner=SimpleNamespace(kv_cache=torch.zeros(1, dtype=torch.bfloat16)))
    assert describe(engine, lora_enabled=True) == KVDescriptor(
        "SmolLM2", "abc", "bfloat16", "bfloat16", tokenizer_digest(tmp_path), 32, "2 x 4 x 16", 8192,
        "max_draft_tokens 8, prompt lookup 4", "rank <= 16")
    assert describe(engine, lora_enabled=False).lora == "off"


def test_the_router_sends_requests_to_paired_replicas_alone_but_pinned_calls_and_those_without_a_request():
    from deployments.pd import routing
    from deployments.pd.routing import EngineRouter

    def replica(rid: str):
        return SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: rid), routing_stats={})

    router = EngineRouter.__new__(EngineRouter)  # its routing alone: no Serve controller behind it
    router._deployment_id = SimpleNamespace(name="DecodeServer")
    a, b = replica("a"), replica("b")
    probe = SimpleNamespace(kwargs={"pinned": "b"}, args=())
    info = SimpleNamespace(kwargs={}, args=())
    call = SimpleNamespace(kwargs={}, args=(GenerationRequest("r", [1, 2, 3], SamplingParams()),),
                           metadata=SimpleNamespace(call_method="decode"))
    try:
        routing.set_paired("DecodeServer", {"a"})
        assert asyncio.run(router.choose_replicas([a, b], call)) == [[a]]
        assert asyncio.run(router.choose_replicas([a, b], probe)) == [[b]]  # the watch's probe reaches b
        routing.set_paired("DecodeServer", set())
        assert asyncio.run(router.choose_replicas([a, b], call)) == []  # none may take it
        assert len(asyncio.run(router.choose_replicas([a, b], info))[0]) == 2  # a call with no request: any
        routing.set_paired("DecodeServer", None)
        ranks = asyncio.run(router.choose_replicas([a, b], call))  # best first, then the rest
        assert sorted(r.replica_id.to_full_id_str() for rank in ranks for r in rank) == ["a", "b"]
    finally:  # what this process's router learnt: no other test's
        routing._paired.clear()
        routing._indexes.pop("DecodeServer", None)
        routing._replica_counts.pop("DecodeServer", None)
        for rid in ("a", "b"):
            routing._sent.pop(rid, None)
