"""LoRA adapters (engine/lora_adapter.py, applied in a step by engine/execution/lora.py): PEFT
directories and TensorRT-LLM's tensors, batched with other adapters and none, checked against
peft's PeftModel.generate in fp32, colocated and split over P and D; the adapter is part of the prefix-cache key."""

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.lora_adapter import TRTLLM_MODULES, LoraAdapter, ModelShape, from_peft, from_trtllm
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.models import load_hf
from tests.test_engine_parity import engine

NEW = 10
PROMPTS = [[5, 9, 30, 31, 32, 7, 12, 99], [200, 201, 17, 4], list(range(40, 61)), [8, 8, 9, 10, 11]]
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out: Path, seed: int, r: int, alpha: int, targets: list[str],
                 rslora: bool = False) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                        use_rslora=rslora)
    model = get_peft_model(load_hf(model_dir, torch.float32), config)
    with torch.no_grad():  # small deltas: the adapters change the tokens without swamping the base model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    llama = model_dirs["llama"]
    return {"all": make_adapter(llama, root / "all", 1, 8, 16, ALL),
            "qv": make_adapter(llama, root / "qv", 2, 4, 8, ["q_proj", "v_proj"], rslora=True)}


def peft_greedy(model_dir: Path, adapter_dir: Path | None) -> list[list[int]]:
    from peft import PeftModel

    model = load_hf(model_dir, torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def references(model_dirs, adapters) -> dict[str | None, list[list[int]]]:
    llama = model_dirs["llama"]
    return {None: peft_greedy(llama, None), **{name: peft_greedy(llama, path) for name, path in adapters.items()}}


def mixed_requests(loaded: dict[str, LoraAdapter]) -> list[tuple[GenerationRequest, str | None]]:
    """Every prompt with every adapter and with none, in one batch."""
    out = []
    for name in (None, *loaded):
        for i, prompt in enumerate(PROMPTS):
            ref = loaded[name].ref if name else None
            out.append((GenerationRequest(f"{name}-{i}", prompt, GREEDY, lora=ref), name))
    return out


def test_mixed_adapters_in_one_batch_equal_peft(model_dirs, adapters, references):
    eng = engine(model_dirs["llama"], dtype="float32", num_blocks=512, max_num_batched_tokens=256)
    loaded = {name: from_peft(name, path) for name, path in adapters.items()}
    assert references["all"] != references[None] != references["qv"]  # each adapter changes the tokens
    requests = mixed_requests(loaded)
    steps_with_all = []
    original = eng.runner._lora_step

    def spy(batch, rows):  # every adapter and the base model share steps
        step = original(batch, rows)
        if step is not None:
            steps_with_all.append({seq.lora.ref.name if seq.lora else None for seq, _ in batch.entries})
        return step

    eng.runner._lora_step = spy
    out = eng.generate([r for r, _ in requests], list(loaded.values()))
    for request, name in requests:
        i = int(request.request_id.rsplit("-", 1)[1])
        assert out[request.request_id].output_token_ids == references[name][i], request.request_id
    assert {None, "all", "qv"} in steps_with_all
    assert eng.block_counts().held == 0


def test_adapters_over_prefill_and_decode_engines(model_dirs, adapters, references):
    loaded = {name: from_peft(name, path) for name, path in adapters.items()}
    p = engine(model_dirs["llama"], dtype="float32", num_blocks=512)
    d = engine(model_dirs["llama"], dtype="float32", num_blocks=512)
    requests = mixed_requests(loaded)
    firsts = p.prefill([r for r, _ in requests], list(loaded.values()))
    finals = d.decode([(r, firsts[r.request_id].prefill) for r, _ in requests], list(loaded.values()))
    for request, name in requests:
        i = int(request.request_id.rsplit("-", 1)[1])
        assert firsts[request.request_id].new_token_ids + finals[request.request_id].output_token_ids[1:] == \
            references[name][i]


def to_trtllm(adapter: LoraAdapter) -> tuple[np.ndarray, np.ndarray]:
    """TensorRT-LLM's lora_weights and lora_config for ``adapter`` (rows padded to the widest)."""
    ids = {target: module for module, target in TRTLLM_MODULES.items()}
    rows, config = [], []
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        rows.append(np.concatenate([a.ravel(), b.ravel()]))
        config.append([ids[target], layer, a.shape[0]])
    width = max(len(r) for r in rows) + 3  # and some padding, as the seed allows
    return np.stack([np.pad(r, (0, width - len(r))) for r in rows]).astype(np.float32), np.array(config)


def test_trtllm_tensors_give_the_peft_adapters_tokens(model_dirs, adapters, references):
    eng = engine(model_dirs["llama"], dtype="float32", num_blocks=512)
    shape = ModelShape.of(eng.loaded.spec)
    peft_all = from_peft("all", adapters["all"])
    weights, config = to_trtllm(peft_all)
    task = from_trtllm("task-7", weights, config, shape)
    out = eng.generate([GenerationRequest(f"t{i}", p, GREEDY, lora=task.ref) for i, p in enumerate(PROMPTS)], [task])
    assert [out[f"t{i}"].output_token_ids for i in range(len(PROMPTS))] == references["all"]
    # attn_qkv (module 0): one A for q, k and v, B's rows split among them.
    a = np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32) * 0.1
    b = np.random.default_rng(1).normal(size=(64 + 32 + 32, 2)).astype(np.float32) * 0.1
    fused = from_trtllm("fused", np.concatenate([a.ravel(), b.ravel()])[None], np.array([[0, 1, 2]]), shape)
    assert set(fused.weights) == {(1, "q"), (1, "k"), (1, "v")}
    np.testing.assert_array_equal(fused.weights[(1, "k")][1], b[64:96])


def test_the_adapter_is_part_of_the_prefix_cache_key(model_dirs, adapters, references):
    eng = engine(model_dirs["llama"], dtype="float32", num_blocks=512)
    lora = from_peft("all", adapters["all"])
    prompt = PROMPTS[2]  # 21 tokens: 5 full blocks of 4
    eng.generate([GenerationRequest("base", prompt, GREEDY)])
    hits = eng.blocks.prefix_hits
    first = eng.generate([GenerationRequest("a", prompt, GREEDY, lora=lora.ref)], [lora])["a"]
    assert eng.blocks.prefix_hits == hits  # the base model's blocks are not this adapter's
    again = eng.generate([GenerationRequest("b", prompt, GREEDY, lora=lora.ref)], [lora])["b"]
    assert eng.blocks.prefix_hits - hits == 20
    assert first.output_token_ids == again.output_token_ids == references["all"][2]


def test_adapter_mistakes_name_the_field(model_dirs, adapters, tmp_path):
    eng = engine(model_dirs["llama"], dtype="float32", num_blocks=64, max_lora_rank=4)
    shape = ModelShape.of(eng.loaded.spec)
    lora = from_peft("all", adapters["all"])  # rank 8
    with pytest.raises(ValueError, match="^lora: rank 8 is over this server's max_lora_rank"):
        eng.validate(GenerationRequest("x", PROMPTS[0], GREEDY, lora=lora.ref), lora=lora)
    with pytest.raises(ValueError, match="^lora: the engine must be given"):
        eng.validate(GenerationRequest("x", PROMPTS[0], GREEDY, lora=lora.ref))
    weights, config = to_trtllm(lora)
    cases = [(weights, np.array([[9, 0, 2]] + config[1:].tolist()), "lora_config: row 0: module id 9"),
             (weights[:, :10], config, "lora_weights: row 0 has 10 values"),
             (weights[:-1], config, "lora_weights: shape"),
             (weights, config[:, :2], "lora_config: shape"),
             (weights, np.array([[1, 0, 0]] + config[1:].tolist()), "lora_config: row 0: adapter size 0")]
    for w, c, message in cases:
        with pytest.raises(ValueError, match=f"^{message}"):
            from_trtllm("bad", w, c, shape)
    bad_layer = config.copy()
    bad_layer[0, 1] = 99
    with pytest.raises(ValueError, match="^lora: layer 99"):
        from_trtllm("bad", weights, bad_layer, shape).check(shape, 16)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true, "r": 2}')
    with pytest.raises(ValueError, match="use_dora"):
        from_peft("dora", tmp_path)


def test_a_replica_keeps_max_loras_adapters_and_fetches_the_others_again():
    import asyncio

    from deployments.replicas.lora_store import LoraCache

    adapters = {a.ref: a for a in (LoraAdapter.of(f"a{i}", {(0, "q"): (np.full((1, 4), i, np.float32),
                                                                         np.ones((4, 1), np.float32))})
                                   for i in range(3))}
    fetched = []

    class Store:  # the LoraStore handle's shape: store.get.remote(ref) is awaited
        class get:
            @staticmethod
            async def remote(ref):
                fetched.append(ref.name)
                return adapters.get(ref)

    async def scenario():
        cache = LoraCache(Store, max_loras=2)
        refs = list(adapters)
        for ref in (refs[0], refs[1], refs[0], refs[2], refs[0], refs[1]):
            assert (await cache.adapter(ref)) is adapters[ref]
        assert await cache.adapter(None) is None
        with pytest.raises(ValueError, match="^lora: adapter 'gone' is no longer held"):
            await cache.adapter(LoraAdapter.of("gone", {}).ref)
        return cache.fetches

    # a0, a1 fetched; a0 hit; a2 fetched (a1, least recently used, forgotten); a0 hit; a1 fetched again
    assert asyncio.run(scenario()) == 4 and fetched == ["a0", "a1", "a2", "a1", "gone"]


def test_lora_modules_in_the_app_args():
    from pydantic import ValidationError

    from deployments.config import AppArgs

    args = AppArgs(lora_modules="style=/a, qv=/b")
    assert args.enable_lora and args.lora_directories == {"style": "/a", "qv": "/b"}
    assert not AppArgs().enable_lora
    for bad in ("style", "style=/a,style=/b", "=/a"):
        with pytest.raises(ValidationError, match="lora_modules"):
            AppArgs(lora_modules=bad)
