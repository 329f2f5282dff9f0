"""The cpu_paged attention kernel against the torch_sdpa reference, and the engine on it against transformers."""

import pytest
import torch

from benchmarks.attention import scattered_step
from engine.execution.attention import AttentionSeq, cpu_paged, select_backend, torch_sdpa
from tests.test_engine_parity import engine, hf_greedy_with_top, prompts, requests

CPU = torch.device("cpu")


def step(specs: list[tuple[int, int]], block_size: int) -> tuple:
    """A step of sequences (start position, new tokens), their blocks scattered over a pool of 256."""
    return scattered_step(specs, 256, block_size)


def attend(backend, seqs, slots, q, k, v, caches, window, block_size):
    k_cache, v_cache = (c.clone() for c in caches)
    out = backend.prepare(slots, seqs, {window}, block_size, CPU).attend(q, k, v, k_cache, v_cache, window)
    return out, k_cache, v_cache


# (start, new tokens) per sequence: decodes, whole prompts, later chunks, drafts, block edges.
STEPS = {
    "decodes": [(0, 1), (15, 1), (16, 1), (47, 1), (200, 1)],
    "prefills": [(0, 33), (0, 16), (17, 40)],
    "mixed": [(37, 1), (20, 30), (0, 50), (15, 1), (100, 7), (63, 1), (64, 2)],
}


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("window", [None, 8, 33])
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("all_rows", [True, False], ids=["invariant", "default"])
def test_cpu_paged_equals_the_reference(dtype, tolerance, heads, window, kind, block_size, all_rows):
    num_heads, num_kv_heads = heads
    seqs, slots = step(STEPS[kind], block_size)
    generator = torch.Generator().manual_seed(1)
    n, d = len(slots), 64
    q, k, v = (torch.randn(n, h, d, generator=generator).to(dtype) for h in (num_heads, num_kv_heads, num_kv_heads))
    caches = [torch.randn(256 * block_size, num_kv_heads, d, generator=generator).to(dtype) for _ in range(2)]
    expected, k_ref, v_ref = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, window, block_size)
    got, k_new, v_new = attend(cpu_paged.backend(all_rows), seqs, slots, q, k, v, caches, window, block_size)
    assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)  # new tokens written to their slots
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40], ids=["fixed-size-path", "any-size-path"])
def test_a_row_is_the_same_whatever_the_step_around_it(dtype, d):
    """The kernel's promise to the batch-invariant mode: a query row's bits do not depend on the
    other rows of its step, nor on whether its position comes in a prefill chunk or as a decode.
    Head dim 64 takes the kernel's compiled-size path, 40 the one with sizes read at run time.
    Beside one short sequence a task takes one kv head; beside twelve decodes, on one thread,
    there are tasks enough for each to take all three (the kernel's kTasksPerThread): both ways
    give the same bits."""
    block_size = 16
    generator = torch.Generator().manual_seed(2)
    seqs, slots = step([(0, 90)], block_size)
    table = seqs[0].block_table
    q, k, v = (torch.randn(90, h, d, generator=generator).to(dtype) for h in (9, 3, 3))
    caches = [torch.zeros(256 * block_size, 3, d, dtype=dtype) for _ in range(2)]
    backend = cpu_paged.backend(all_rows=True)
    whole, k_cache, v_cache = attend(backend, seqs, slots, q, k, v, caches, None, block_size)
    reference, _, _ = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, None, block_size)
    torch.testing.assert_close(whole.float(), reference.float(), atol=2e-2, rtol=2e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for start, n in [(0, 7), (7, 57), (64, 1), (65, 25)]:  # chunks of 7, 57, a decode, 25: the same bits
            for beside in ([(5, 3)], [(p, 1) for p in range(5, 17)]):  # another sequence, or twelve decodes
                chunk, flat = [AttentionSeq(0, n, start, table)], n
                for p, m in beside:  # sequences sharing the table: they rewrite the K/V already there
                    chunk.append(AttentionSeq(flat, m, p, table))
                    flat += m
                rows = [torch.arange(start, start + n)] + [torch.arange(p, p + m) for p, m in beside]
                rows = torch.cat(rows)
                out = backend.prepare(slots[rows], chunk, {None}, block_size, CPU).attend(
                    q[rows], k[rows], v[rows], k_cache, v_cache, None)
                assert torch.equal(out[:n], whole[start:start + n]), (start, n, len(beside))
    finally:
        torch.set_num_threads(threads)


def test_backend_choice():
    auto = select_backend("auto", CPU, torch.float32)
    assert auto.name == "cpu_paged" and not auto.all_rows  # measured the faster; prefill chunks on flash SDPA
    assert not select_backend("cpu_paged", CPU, torch.float32).all_rows  # prefill chunks on flash SDPA
    assert select_backend("auto", CPU, torch.bfloat16, batch_invariant=True).all_rows
    assert select_backend("auto", CPU, torch.float64).name == "torch_sdpa"  # the kernel takes no float64
    assert select_backend("torch_sdpa", CPU, torch.float32).name == "torch_sdpa"
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("cpu_paged", CPU, torch.float64)
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("flash", CPU, torch.float32)


def test_float32_greedy_on_the_kernel_equals_transformers(model_dirs):
    """Every architecture's shape (GQA, Qwen3's head_dim, Mistral's window) through the kernel, in
    chunks of 32 tokens over blocks of 4, with preemption: tokens equal to transformers' in float32."""
    prompt_ids = prompts()
    for arch, model_dir in model_dirs.items():
        reference = [tokens for tokens, _ in hf_greedy_with_top(model_dir, prompt_ids, torch.float32)]
        llm = engine(model_dir, dtype="float32", attention_backend="cpu_paged", num_blocks=40)
        assert llm.runner.attention.name == "cpu_paged"
        results = llm.generate(requests(prompt_ids))
        assert [results[f"r{i}"].output_token_ids for i in range(len(prompt_ids))] == reference, arch
        assert llm.scheduler.num_preemptions > 0 or arch != "llama"
