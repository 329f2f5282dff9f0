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
