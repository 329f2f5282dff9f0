"""The P/D compatibility check (deployments/pd/compatibility.py), model-free: every field of the KV
descriptor a P and a D may differ in is named; the pairing keeps the descriptor most replicas
share and leaves the others unpaired; with none shared every D is unpaired and P is not; the
tokenizer digest follows the tokenizer's files and nothing else; a descriptor is read from an
engine's loaded model and config. The served check: tests/test_compatibility_served.py."""

import asyncio
import threading
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.serve._private.request_router.common import RequestRoutingContext
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


def _replica(rid: str):
    return SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: rid), routing_stats={})


def _call(method: str, *args, **kwargs):
    """A pending call as Serve's router holds it (its fields this router reads)."""
    return SimpleNamespace(kwargs=kwargs, args=args, metadata=SimpleNamespace(call_method=method),
                           routing_context=RequestRoutingContext())


def _router(deployment: str, replicas: list):
    from deployments.pd.routing import EngineRouter

    router = EngineRouter.__new__(EngineRouter)  # its routing alone: no Serve controller behind it
    router._deployment_id = SimpleNamespace(name=deployment)
    router._replicas = {r.replica_id.to_full_id_str(): r for r in replicas}  # what Serve's retry loop reads
    router._replicas_list = list(replicas)
    router.num_routing_tasks_in_backoff = 0
    router.num_routing_tasks_in_backoff_gauge = SimpleNamespace(set=lambda value: None)
    router.update_backoff_params(initial_backoff_s=0.01, backoff_multiplier=2, max_backoff_s=0.05)
    return router


def _forget_routing(deployment: str, replica_ids: tuple[str, ...]) -> None:
    """What this process's router learnt: no other test's."""
    from deployments.pd import routing

    routing._paired.clear()
    routing._indexes.pop(deployment, None)
    routing._replica_counts.pop(deployment, None)
    for rid in replica_ids:
        routing._sent.pop(rid, None)


def test_the_router_sends_requests_to_paired_replicas_alone_but_pinned_calls_and_those_without_a_request():
    from deployments.pd import routing

    a, b = _replica("a"), _replica("b")
    router = _router("DecodeServer", [a, b])
    probe, info = _call("answering", pinned="b"), _call("info")
    call = _call("decode", GenerationRequest("r", [1, 2, 3], SamplingParams()))
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
    finally:
        _forget_routing("DecodeServer", ("a", "b"))


def test_a_call_no_replica_may_take_leaves_the_routers_loop_running_and_is_routed_once_one_may():
    """Serve's own retry loop (RequestRouter._choose_replicas_with_backoff) over this router, for a D
    call while no D is paired: the loop it runs in (shared by every handle of the ingress) runs other
    tasks between the tries, and the call goes to the replica paired later. A retry that never yields
    would starve every router of the process (issue 55's CI failure: no P call routed after D was
    found unpaired)."""
    from deployments.pd import routing

    a = _replica("a")
    router = _router("DecodeServer", [a])
    call = _call("decode", GenerationRequest("r", [1, 2, 3], SamplingParams()))
    ticks = []  # another task's turns while the call waits

    async def route_while_ticking():
        async def first_choice():
            async for replicas in router._choose_replicas_with_backoff(call):
                return replicas

        routing_task = asyncio.create_task(first_choice())
        for _ in range(3):
            await asyncio.sleep(0.01)
            ticks.append(routing_task.done())
        routing.set_paired("DecodeServer", {"a"})
        return await routing_task

    routed = []
    thread = threading.Thread(target=lambda: routed.append(asyncio.run(route_while_ticking())), daemon=True)
    try:
        routing.set_paired("DecodeServer", set())
        thread.start()
        thread.join(30)
        starved = thread.is_alive()
        routing.set_paired("DecodeServer", {"a"})  # ends a spinning retry loop, if there is one
        thread.join(30)
        assert not starved, "the router's retry loop never let another task of its event loop run"
        assert ticks == [False, False, False] and routed == [[a]]
    finally:
        _forget_routing("DecodeServer", ("a",))
