"""The Ascend path against a torch_npu stand-in that computes the operator's published reference
(seeds/003's formula, as torch_npu's own golden test writes it): arguments, dtypes, the start-up
check, and a seeded request drawing the same token on both backends."""

import sys
import types

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import Sampler, SamplingParams
from sampling.npu import AscendTopKTopPSampler
from tests.sampling_helpers import batch_of


def operator_reference(logits, top_k, top_p, q, eps):
    """aclnnTopKTopPSample, row by row: a stable descending sort; top-k when 1 <= k <= min(V, 1024);
    top-p when 0 < p < 1 (drop a token when the mass before it exceeds p); then
    argmax(softmax(kept) / (q[b, :len(kept)] + eps)), q read in the kept candidates' order; a row
    neither stage sorted races over the vocabulary in token order."""
    vocab = logits.shape[1]
    chosen = []
    for b in range(logits.shape[0]):
        row, k, p = logits[b].float(), int(top_k[b]), float(top_p[b])
        k_on, p_on = 1 <= k <= min(vocab, 1024), 0.0 < p < 1.0
        values, ids = row, torch.arange(vocab)
        if k_on or p_on:
            values, ids = row.sort(descending=True, stable=True)
            if k_on:
                values, ids = values[:k], ids[:k]
            if p_on:
                probs = values.softmax(-1)
                keep = ~((probs.cumsum(-1) - probs) > p)
                values, ids = values[keep], ids[keep]
        probs = values.softmax(-1)
        scores = probs if q is None else probs / (q[b, : len(values)].abs() + eps)
        chosen.append(ids[scores.argmax()])
    return torch.stack(chosen)


class TorchNpuStandIn(types.ModuleType):
    """Records every call, checks the documented dtypes and shapes (the operator refuses others),
    and answers with the reference formula (or a fixed token)."""

    def __init__(self, fixed_token=None, fails=False):
        super().__init__("torch_npu")
        self.calls = []
        self.fixed_token = fixed_token
        self.fails = fails

    def npu_top_k_top_p_sample(self, logits, top_k, top_p, *, q, eps, is_need_logits, top_k_guess):
        if self.fails:
            raise RuntimeError("aclnnTopKTopPSample: not supported on this SoC")
        assert logits.dtype in (torch.float16, torch.bfloat16) and logits.dim() == 2
        assert top_k.dtype == torch.int32 and top_p.dtype == logits.dtype
        assert q.dtype == torch.float32 and q.shape == logits.shape
        self.calls.append(dict(logits=logits, top_k=top_k, top_p=top_p, q=q, eps=eps,
                               is_need_logits=is_need_logits, top_k_guess=top_k_guess))
        if self.fixed_token is not None:
            chosen = torch.full((logits.shape[0],), self.fixed_token, dtype=torch.int64)
        else:
            chosen = operator_reference(logits, top_k, top_p, q, eps)
        return chosen, None


@pytest.fixture
def stub(monkeypatch):
    module = TorchNpuStandIn()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def test_a_seeded_row_draws_the_same_token_on_the_operator_and_on_the_native_path(stub):
    """Seeded rows with top-k, top-p, both and neither; logits fp16 values, so that both paths see
    the same numbers. The native path reads q in candidate order, as the operator does."""
    vocab, rows = 512, 96
    generator = torch.Generator().manual_seed(41)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).half().float()
    choices = [dict(top_k=5), dict(top_k=40), dict(top_k=300), dict(top_p=0.9), dict(top_p=0.5),
               dict(top_k=50, top_p=0.8), dict(top_k=1024, top_p=0.95), dict()]
    params = [SamplingParams(**choices[i % len(choices)]) for i in range(rows)]
    seeds = torch.randint(1, 2**62, (rows,), generator=generator).tolist()
    batch = batch_of(params, vocab, seeds=seeds)
    on_operator = Sampler(torch.device("cpu"), vocab, backend="ascend")(logits.clone(), batch).token_ids
    native = Sampler(torch.device("cpu"), vocab, backend="native")(logits.clone(), batch).token_ids
    assert len(stub.calls) == 2  # the start-up probe, then the batch
    assert on_operator == native
    # The rows really were random draws: not every row took its argmax.
    assert sum(t != a for t, a in zip(native, logits.argmax(-1).tolist())) > rows // 4


def test_ties_at_the_top_k_edge_go_to_the_lowest_ids_on_both_paths(stub):
    vocab = 200
    logits = torch.zeros(4, vocab)
    logits[0, :5] = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # k = 2 keeps ids 0 and 1
    logits[1, 150:] = 2.0  # 50 tied at the top, k = 3 keeps 150, 151, 152
    params = [SamplingParams(top_k=2), SamplingParams(top_k=3), SamplingParams(top_p=0.052),
              SamplingParams(top_k=100, top_p=0.5)]
    for seed in range(1, 40):
        batch = batch_of(params, vocab, seeds=[seed] * 4)
        native = Sampler(torch.device("cpu"), vocab)(logits.clone(), batch).token_ids
        assert native[0] in (0, 1) and native[1] in (150, 151, 152)
        assert 0 <= native[2] <= 10  # 1/200 each: 11 tokens until the mass before exceeds 0.052
        assert 0 <= native[3] < 50
        reference = operator_reference(logits, batch.top_k.int(), batch.top_p, None, 1e-8)
        assert reference.tolist() == [0, 150, 0, 0]


def test_operator_called_by_keyword_with_documented_dtypes_keeping_top_p(stub):
    vocab = 100
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.999), SamplingParams(),
              SamplingParams(top_k=3, top_p=0.9)]
    batch = batch_of(params, vocab)
    Sampler(torch.device("cpu"), vocab, backend="ascend")(torch.randn(4, vocab), batch)
    call = stub.calls[-1]
    assert call["logits"].dtype == torch.float16 and call["logits"].shape == (4, vocab)
    assert call["top_k"].dtype == torch.int32 and call["top_k"].tolist() == [5, 0, 0, 3]
    top_p = call["top_p"].float().tolist()
    assert call["top_p"].dtype == torch.float16
    assert top_p[1] < 1.0 and abs(top_p[1] - 0.999) <= 2**-11  # not rounded up to 1 (top-p skipped)
    assert abs(top_p[3] - 0.9) <= 2**-11 and top_p[0] == top_p[2] == 1.0
    assert call["q"].dtype == torch.float32 and call["q"].shape == (4, vocab)
    assert call["eps"] == 1e-8 and call["is_need_logits"] is False and call["top_k_guess"] == 32


def test_a_top_p_the_dtype_would_round_to_one_is_sampled_natively(stub, caplog):
    vocab = 100
    sampler = Sampler(torch.device("cpu"), vocab, backend="ascend")
    probes = len(stub.calls)
    sampler(torch.randn(2, vocab), batch_of([SamplingParams(top_p=0.9999)] * 2, vocab))  # fp16: 1.0
    huge = torch.randn(2, vocab) * 1e5  # past fp16's range: bf16, where 0.999 is 1.0
    sampler(huge, batch_of([SamplingParams(top_p=0.999)] * 2, vocab))
    assert len(stub.calls) == probes
    assert sum("rounds to 1" in r.message for r in caplog.records) == 2  # float16, then bfloat16


def test_k_above_the_operator_limit_falls_back_to_native(stub, caplog):
    vocab = 3000
    batch = batch_of([SamplingParams(top_k=2000)] * 2, vocab)
    sampler = Sampler(torch.device("cpu"), vocab, backend="ascend")
    probes = len(stub.calls)
    for _ in range(2):
        sampler(torch.randn(2, vocab), batch)
    assert len(stub.calls) == probes
    assert sum("falls back" in r.message for r in caplog.records) == 1  # logged once


@pytest.mark.parametrize("module, reason", [
    (None, "torch_npu does not import"),
    (types.ModuleType("torch_npu"), "has no npu_top_k_top_p_sample"),
    (TorchNpuStandIn(fails=True), "the operator fails on cpu"),
    (TorchNpuStandIn(fixed_token=3), "answered token 3, not 2"),
])
def test_start_up_check_names_why_the_operator_is_not_used(monkeypatch, module, reason):
    monkeypatch.setitem(sys.modules, "torch_npu", module)  # None: the import fails
    backend, why = AscendTopKTopPSampler.open(torch.device("cpu"), 100)
    assert backend is None and reason in why
    with pytest.raises(RuntimeError, match=f"sampler_backend: ascend is not available: .*{reason}"):
        Sampler(torch.device("cpu"), 100, backend="ascend")
    assert AscendTopKTopPSampler.open(torch.device("cpu"), 2**20 + 1)[1].startswith("the vocabulary")


def test_operator_result_flows_into_engine_output(monkeypatch):
    stub = TorchNpuStandIn()
    monkeypatch.setitem(sys.modules, "torch_npu", stub)
    engine = LLMEngine(EngineConfig(model="tiny-llama", sampler_backend="ascend"))
    assert engine.runner.sampler.backend_name == "ascend"
    stub.fixed_token = 7
    result = engine.generate([GenerationRequest("r", [5, 6, 7], SamplingParams(max_new_tokens=4, top_k=5))])["r"]
    assert result.output_token_ids == [7, 7, 7, 7]
    assert len(stub.calls) == 1 + 4  # the probe, then one call a step


def test_package_imports_without_torch_npu():
    assert "torch_npu" not in sys.modules
    assert Sampler(torch.device("cpu"), 10).backend_name == "native"
