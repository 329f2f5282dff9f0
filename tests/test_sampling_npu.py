"""The Ascend path with a stub torch_npu: arguments, dtypes, shapes, and the result flowing back."""

import sys
import types

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import Sampler, SamplingParams
from sampling.topk_topp import top_k_top_p_sample
from tests.sampling_helpers import batch_of


class StubTorchNpu(types.ModuleType):
    """Records every call; answers with the native reference run on the given q (or a fixed token)."""

    def __init__(self, fixed_token=None):
        super().__init__("torch_npu")
        self.calls = []
        self.fixed_token = fixed_token

    def npu_top_k_top_p_sample(self, logits, top_k, top_p, *, q, eps, is_need_logits, top_k_guess):
        self.calls.append(dict(logits=logits, top_k=top_k, top_p=top_p, q=q, eps=eps,
                               is_need_logits=is_need_logits, top_k_guess=top_k_guess))
        if self.fixed_token is not None:
            chosen = torch.full((logits.shape[0],), self.fixed_token, dtype=torch.int64)
        else:
            chosen = top_k_top_p_sample(logits.float(), top_k.long(), top_p.float(),
                                        lambda rows, ids: q[rows[:, None], ids] if ids.dim() == 2 else q[rows][:, ids])
        return chosen, None


@pytest.fixture
def stub(monkeypatch):
    module = StubTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def test_operator_called_by_keyword_with_documented_dtypes(stub):
    vocab = 100
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.9), SamplingParams(), SamplingParams(top_k=3, top_p=0.5)]
    batch = batch_of(params, vocab)
    logits = torch.randn(4, vocab)
    out = Sampler(torch.device("cpu"), vocab, backend="ascend")(logits.clone(), batch)
    (call,) = stub.calls
    assert call["logits"].dtype == torch.bfloat16 and call["logits"].shape == (4, vocab)
    assert call["top_k"].dtype == torch.int32 and call["top_k"].tolist() == [5, 0, 0, 3]
    assert call["top_p"].dtype == torch.bfloat16 and call["top_p"].shape == (4,)
    assert call["q"].dtype == torch.float32 and call["q"].shape == (4, vocab)
    assert call["eps"] == 1e-8 and call["is_need_logits"] is False and call["top_k_guess"] == 32
    # The stub answers with the reference on the same q: the Ascend path samples what native does.
    native = Sampler(torch.device("cpu"), vocab)(logits.to(torch.bfloat16).float(), batch)
    assert out.token_ids == native.token_ids


def test_k_above_the_operator_limit_falls_back_to_native(stub, caplog):
    vocab = 3000
    batch = batch_of([SamplingParams(top_k=2000)] * 2, vocab)
    sampler = Sampler(torch.device("cpu"), vocab, backend="ascend")
    for _ in range(2):
        sampler(torch.randn(2, vocab), batch)
    assert stub.calls == []
    assert sum("falls back" in r.message for r in caplog.records) == 1  # logged once


def test_operator_result_flows_into_engine_output(monkeypatch):
    stub = StubTorchNpu(fixed_token=7)
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    engine = LLMEngine(EngineConfig(model="tiny-llama", sampler_backend="ascend"))
    result = engine.generate([GenerationRequest("r", [5, 6, 7], SamplingParams(max_new_tokens=4, top_k=5))])["r"]
    assert result.output_token_ids == [7, 7, 7, 7]
    assert len(stub.calls) == 4


def test_package_imports_without_torch_npu():
    assert "torch_npu" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        Sampler(torch.device("cpu"), 10, backend="ascend")
