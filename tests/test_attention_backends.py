"""The cpu_paged attention kernel against the torch_sdpa reference (at the head sizes and GQA
ratios real models use, and in each instruction-set build this CPU runs), and the engine on it
against transformers."""

import pytest
import torch

from benchmarks import kernel_isa_paths
from benchmarks.attention import scattered_step
from engine.execution.attention import AttentionSeq, cpu_paged, select_backend, torch_sdpa
from engine.execution.loader import cpu_flags
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


def random_step(kind: str, block_size: int, head_dim: int, heads: tuple[int, int], dtype: torch.dtype, seed: int):
    """STEPS[kind] over a pool just large enough for it: (seqs, slots, q, k, v, caches)."""
    num_heads, num_kv_heads = heads
    num_blocks = sum(-(-(start + n) // block_size) for start, n in STEPS[kind]) + 8
    seqs, slots = scattered_step(STEPS[kind], num_blocks, block_size)
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(slots), h, head_dim, generator=generator).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    caches = [torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
              for _ in range(2)]
    return seqs, slots, q, k, v, caches


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("window", [None, 8, 33])
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("all_rows", [True, False], ids=["invariant", "default"])
def test_cpu_paged_equals_the_reference(dtype, tolerance, heads, window, kind, block_size, all_rows):
    seqs, slots, q, k, v, caches = random_step(kind, block_size, 64, heads, dtype, seed=1)
    expected, k_ref, v_ref = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, window, block_size)
    got, k_new, v_new = attend(cpu_paged.backend(all_rows), seqs, slots, q, k, v, caches, window, block_size)
    assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)  # new tokens written to their slots
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


# Llama 3 and Qwen3 use 128, Phi-3 and Mistral's small ones 96, some 80 or 256; 64 and 128 at
# block 16 take the kernel's compiled-size path, the rest the path with sizes read at run time.
REAL_HEAD_SIZES = (64, 80, 96, 128, 256)
# Every head size with every GQA ratio at the default block size, and with the smallest and the
# largest block the kernel takes at one ratio; float32, and bfloat16 at each head size.
SHAPES = ([(torch.float32, d, group, 16) for d in REAL_HEAD_SIZES for group in (1, 4, 8)]
          + [(torch.float32, d, 4, block) for d in REAL_HEAD_SIZES for block in (1, cpu_paged.MAX_BLOCK_SIZE)]
          + [(torch.bfloat16, d, 4, 16) for d in REAL_HEAD_SIZES])
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype,head_dim,group,block_size", [
    pytest.param(*shape, id=f"{str(shape[0]).removeprefix('torch.')}-d{shape[1]}-gqa{shape[2]}-block{shape[3]}")
    for shape in SHAPES])
def test_cpu_paged_at_the_head_sizes_models_use(dtype, head_dim, group, block_size):
    """Every row on the kernel (batch-invariant mode): decodes, whole prompts, later chunks and
    drafts of one step, with and without a sliding window, equal to the reference."""
    seqs, slots, q, k, v, caches = random_step("mixed", block_size, head_dim, (2 * group, 2), dtype, seed=3)
    for window in (None, 33):
        expected, k_ref, v_ref = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, window, block_size)
        got, k_new, v_new = attend(cpu_paged.backend(all_rows=True), seqs, slots, q, k, v, caches, window,
                                   block_size)
        assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def runnable_builds() -> list[str]:
    """The instruction-set builds of the kernel (benchmarks/kernel_isa_paths.py) this CPU runs,
    its own (-march=native) first."""
    flags = cpu_flags()
    return [name for name in kernel_isa_paths.BUILDS if kernel_isa_paths.NEEDS.get(name, "") in flags | {""}]


@pytest.mark.slow
def test_each_instruction_set_build_equals_the_reference(monkeypatch):
    """The kernel transposes keys with AVX-512 or AVX2 register transposes, or a plain loop,
    chosen at compile time; the suite's other tests run this CPU's own. Here every build this
    CPU can run (its own is the installed one; `make test` compiles the others into torch's
    extension cache, a minute each on 2 cores, and they are loaded from it) is compared with the
    reference, and the builds with each other: the transposes move data only, so the bits are
    the same."""
    names = runnable_builds()
    kernels = {names[0]: cpu_paged.extension()}
    kernels |= {name: kernel_isa_paths.build(name, kernel_isa_paths.BUILDS[name]) for name in names[1:]}
    assert "plain" in kernels and len(kernels) >= 2 or not {"avx2", "avx512f"} & cpu_flags()
    shapes = [(torch.float32, 2e-6, 128, 16, (8, 2)), (torch.float32, 2e-6, 80, 16, (9, 3)),
              (torch.bfloat16, 2e-2, 64, 16, (4, 4)), (torch.float16, 4e-3, 96, 8, (8, 1))]
    for dtype, tolerance, head_dim, block_size, heads in shapes:
        seqs, slots, q, k, v, caches = random_step("mixed", block_size, head_dim, heads, dtype, seed=4)
        expected, _, _ = attend(torch_sdpa.BACKEND, seqs, slots, q, k, v, caches, None, block_size)
        outs = {}
        for name, kernel in kernels.items():
            monkeypatch.setattr(cpu_paged, "extension", lambda kernel=kernel: kernel)
            outs[name], _, _ = attend(cpu_paged.PagedBackend(all_rows=True), seqs, slots, q, k, v, caches, None,
                                      block_size)
            where = f"{name} build, {dtype}, head {head_dim}"
            torch.testing.assert_close(outs[name].float(), expected.float(), atol=tolerance, rtol=tolerance,
                                       msg=lambda m, where=where: f"{where}: {m}")
        for name, out in outs.items():
            assert torch.equal(out, outs[names[0]]), (name, dtype, head_dim)


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


def test_float32_greedy_on_the_kernel_equals_transformers(model_dirs, llama_head128_dir):
    """Every architecture's shape (GQA, Qwen3's head_dim, Mistral's window) through the kernel, in
    chunks of 32 tokens over blocks of 4, with preemption, and Llama 3's head size (128) over blocks
    of 16 (the kernel's compiled 16 x 128 path): tokens equal to transformers' in float32."""
    prompt_ids = prompts()
    for arch, model_dir in {**model_dirs, "llama-head128": llama_head128_dir}.items():
        reference = [tokens for tokens, _ in hf_greedy_with_top(model_dir, prompt_ids, torch.float32)]
        blocks = {"block_size": 16, "num_blocks": 12} if arch == "llama-head128" else {"num_blocks": 40}
        llm = engine(model_dir, dtype="float32", attention_backend="cpu_paged", **blocks)
        assert llm.runner.attention.name == "cpu_paged"
        results = llm.generate(requests(prompt_ids))
        assert [results[f"r{i}"].output_token_ids for i in range(len(prompt_ids))] == reference, arch
        assert llm.scheduler.num_preemptions > 0 or arch != "llama"
