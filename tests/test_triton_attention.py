"""The triton_paged kernels against the torch_sdpa reference.

Without a GPU, Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) runs the
kernels' code with numpy on CPU tensors, so every run of the suite checks the CUDA backend's
arithmetic and indexing; with one, the same tests run the compiled kernels on it: head sizes 64, 80 and
128, GQA 1, 3 and 4, block tables with holes, chunked prefill after a prefix hit, sliding windows,
mixed prefill + decode steps, and the padding rows of a CUDA graph. What the interpreter cannot
show (speed, CUDA graphs, TF32) is measured on a GPU by benchmarks/gpu.py.
"""

import os

import pytest
import torch

from benchmarks.attention import scattered_step
from engine.execution.attention import AttentionSeq, select_backend, torch_sdpa, triton_paged
from tests.test_engine_parity import engine, hf_greedy_with_top, prompts, requests

CPU = torch.device("cpu")
DEVICE = torch.device("cuda") if torch.cuda.is_available() else CPU
POOL_BLOCKS = 64

# (start, new tokens) per sequence: decodes at block edges, whole prompts, a chunk after a cached
# prefix (start > 0), drafts, and a step that mixes them.
STEPS = {
    "decodes": [(0, 1), (15, 1), (16, 1), (47, 1), (130, 1)],
    "prefills": [(0, 33), (17, 40)],
    "mixed": [(37, 1), (20, 30), (0, 19), (63, 1), (64, 3)],
}


def attend(backend, seqs, slots, q, k, v, caches, window, block_size):
    """One layer's attention on DEVICE; the output and the caches after it, on the CPU."""
    q, k, v, slots = (t.to(DEVICE) for t in (q, k, v, slots))
    k_cache, v_cache = (c.to(DEVICE, copy=True) for c in caches)
    out = backend.prepare(slots, seqs, {window}, block_size, DEVICE).attend(q, k, v, k_cache, v_cache, window)
    return out.cpu(), k_cache.cpu(), v_cache.cpu()


def inputs(num_rows: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, block_size: int):
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(num_rows, h, head_dim, generator=generator).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    caches = [torch.randn(POOL_BLOCKS * block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
              for _ in range(2)]
    return q, k, v, caches


CASES = [  # (heads, head_dim, window, block_size): GQA 1/4/3, head sizes 64/128/80, windows, block sizes
    ((4, 4), 64, None, 16),
    ((8, 2), 128, None, 16),
    ((9, 3), 64, 8, 4),
    ((4, 1), 80, 33, 16),
]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,head_dim,window,block_size", CASES)
@pytest.mark.parametrize("kind", list(STEPS))
def test_triton_paged_equals_the_reference(dtype, tolerance, heads, head_dim, window, block_size, kind):
    seqs, slots = scattered_step(STEPS[kind], POOL_BLOCKS, block_size)  # blocks drawn at random: holes
    q, k, v, caches = inputs(len(slots), heads, head_dim, dtype, block_size)
    expected, k_ref, v_ref = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, window, block_size)
    backend = triton_paged.TritonPagedBackend(group=heads[0] // heads[1])
    got, k_new, v_new = attend(backend, seqs, slots, q, k, v, caches, window, block_size)
    assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)  # new tokens written to their slots
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_graph_padding_rows_write_nothing_and_leave_the_real_rows_exact():
    """A CUDA graph's batch is padded: padding rows have slot -1 and padding sequences no new
    tokens. They must not write the pool, and the real rows must equal an unpadded step's."""
    block_size, heads = 16, (8, 2)
    seqs, slots = scattered_step([(5, 1), (40, 1), (16, 1)], POOL_BLOCKS, block_size)
    q, k, v, caches = inputs(len(slots) + 2, heads, 64, torch.float32, block_size)
    backend = triton_paged.TritonPagedBackend(group=4)
    real = slice(0, len(slots))
    expected, k_ref, v_ref = attend(backend, seqs, slots, q[real], k[real], v[real], caches, None, block_size)
    padded_seqs = seqs + [AttentionSeq(len(slots) + i, 0, 0, []) for i in range(2)]
    padded_slots = torch.cat([slots, torch.tensor([-1, -1])])
    got, k_new, v_new = attend(backend, padded_seqs, padded_slots, q, k, v, caches, None, block_size)
    assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)
    assert torch.equal(got[real], expected)


def test_the_plan_has_one_work_item_per_tile_of_new_tokens():
    seqs = [AttentionSeq(0, 1, 9, [3]), AttentionSeq(1, 70, 0, [0, 1, 2, 4, 5]), AttentionSeq(71, 0, 0, [])]
    plan = triton_paged.plan_step(seqs, block_q=32)
    assert plan.work.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2]]  # 1 token: 1 tile; 70: 3; none: none
    assert plan.seq_info.tolist() == [[0, 1, 9], [1, 70, 0], [71, 0, 0]]
    assert plan.tables.tolist() == [[3, 0, 0, 0, 0], [0, 1, 2, 4, 5], [0, 0, 0, 0, 0]]
    assert triton_paged.tile_tokens(group=4, prefill=False) == 4  # 4 tokens x 4 heads: a 16-row tile
    assert triton_paged.tile_tokens(group=3, prefill=True) == 32  # the group padded to 4


def test_the_interpreter_runs_the_kernels_where_no_gpu_is():
    assert DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def test_backend_choice_on_each_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend: triton_paged runs on CUDA"):
        select_backend("triton_paged", CPU, torch.float32)
    with pytest.raises(ValueError, match="attention_backend: cpu_paged"):
        select_backend("cpu_paged", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="attention_backend: triton_paged takes"):
        select_backend("triton_paged", torch.device("cuda"), torch.float64)
    assert select_backend("auto", torch.device("cuda"), torch.bfloat16, group=4).name == "triton_paged"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton_paged", CPU, torch.float32, group=2).group == 2


@pytest.mark.slow
def test_float32_greedy_on_the_kernels_equals_transformers(model_dirs):
    """Llama's shape (GQA) and Mistral's (a sliding window) through the CUDA path's kernels (the
    attention and the fused RMSNorm, RoPE in place on qkv's views, SiLU*mul), in chunks of 32
    tokens over blocks of 4, with preemption: tokens equal to transformers' in float32. (Two of the
    architectures: the interpreter is slow; the kernel tests cover the other head sizes.)"""
    prompt_ids = prompts()
    for arch in ("llama", "mistral"):
        model_dir = model_dirs[arch]
        reference = [tokens for tokens, _ in hf_greedy_with_top(model_dir, prompt_ids, torch.float32)]
        llm = engine(model_dir, dtype="float32", device=DEVICE.type, attention_backend="triton_paged", num_blocks=40)
        assert llm.runner.attention.name == "triton_paged"
        llm.loaded.model.use_fused_ops()  # what the runner does on CUDA
        assert all(layer.fused is not None for layer in llm.loaded.model.layers)
        results = llm.generate(requests(prompt_ids))
        assert [results[f"r{i}"].output_token_ids for i in range(len(prompt_ids))] == reference, arch
        assert llm.scheduler.num_preemptions > 0 or arch != "llama"
