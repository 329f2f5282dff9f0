"""CUDA graphs for decode steps (engine/execution/cuda_graphs.py): needs a GPU (marked cuda; left
out elsewhere, and the run says so). Graph replay must give the eager step's tokens, at batch
sizes that pad to a captured size and past the largest one (those steps run eagerly)."""

import pytest
import torch

from engine.execution.cuda_graphs import capture_sizes
from tests.test_engine_parity import engine, prompts, requests


def test_capture_sizes_follow_vllm_and_end_at_the_largest_batch():
    assert capture_sizes(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and capture_sizes(256)[-1] == 256
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(3) == [1, 2, 3]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_gives_the_eager_tokens(model_dirs, dtype):
    prompt_ids = prompts()  # 8 prompts: steps of 8 rows pad to the graph of 8; a cap of 4 sends them eager
    settings = dict(dtype=dtype, device="cuda", block_size=16, max_num_batched_tokens=512)
    eager = engine(model_dirs["llama"], enforce_eager=True, **settings)
    assert eager.runner.graphs is None
    expected = eager.generate(requests(prompt_ids))
    for max_batch in (256, 4):
        graphs = engine(model_dirs["llama"], max_cuda_graph_batch=max_batch, **settings)
        assert graphs.runner.graphs is not None and graphs.runner.graphs.max_batch == min(max_batch, 256)
        got = graphs.generate(requests(prompt_ids))
        assert {r: o.output_token_ids for r, o in got.items()} == {r: o.output_token_ids for r, o in expected.items()}


def test_graph_inputs_fill_the_rows_then_padding():
    import numpy as np

    from engine.execution.cuda_graphs import GraphInputs, meta_views

    staging = GraphInputs(largest=8, table_width=4, pinned=False)
    used = staging.fill(np.array([7, 8]), np.array([5, 17]), np.array([21, 70]), [[5, 3], [1, 4, 2, 6]], size=4)
    assert used == 4 * (4 + 5)
    assert staging.tokens[:, :4].tolist() == [[7, 8, 0, 0], [5, 17, 0, 0], [21, 70, -1, -1]]
    tables, seq_info, work = meta_views(staging.meta, 4, 4)
    assert tables.tolist() == [[5, 3, 0, 0], [1, 4, 2, 6], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert seq_info.tolist() == [[0, 1, 5], [1, 1, 17], [2, 0, 0], [3, 0, 0]]
    assert work.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]
    staging.fill(np.array([9]), np.array([2]), np.array([3]), [[8]], size=2)  # a smaller step after a larger
    tables, seq_info, _ = meta_views(staging.meta, 2, 4)
    assert tables.tolist() == [[8, 0, 0, 0], [0, 0, 0, 0]] and seq_info.tolist() == [[0, 1, 2], [1, 0, 0]]


def test_graph_inputs_take_the_persistent_batchs_table_array():
    """A decode step from the persistent batch hands its tables as one array [n, w] (0 past each
    table's end, w narrower or wider than the graph's width): the staging is the lists'."""
    import numpy as np

    from engine.execution.cuda_graphs import GraphInputs

    for lists in ([[5, 3], [1, 4, 2, 6], [9]], [[5, 3], [1], [9, 2]]):
        for width in sorted({max(map(len, lists)), 6}):  # as wide as the widest table (the step's), or wider
            array = np.zeros((3, width), dtype=np.int32)
            for i, table in enumerate(lists):
                array[i, :len(table)] = table
            from_lists, from_array = (GraphInputs(largest=8, table_width=4, pinned=False) for _ in range(2))
            from_lists.fill(np.array([7, 8, 9]), np.array([5, 17, 1]), np.array([21, 70, 3]), lists, size=4)
            from_array.fill(np.array([7, 8, 9]), np.array([5, 17, 1]), np.array([21, 70, 3]), array, size=4)
            assert from_array.meta.tolist() == from_lists.meta.tolist(), (lists, width)
            assert from_array.tokens.tolist() == from_lists.tokens.tolist()
