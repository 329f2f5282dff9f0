"""P-tuning prompt tables (TensorRT-LLM's prompt_embedding_table / prompt_vocab_size): prompt ids
past the vocabulary take their embedding from the request's table. Checked against transformers
run with ``inputs_embeds`` built the same way, in fp32; the table is part of the prefix-cache key."""

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, Mode, PromptTable
from sampling import SamplingParams
from tests.models import load_hf
from tests.test_engine_parity import engine

NEW = 8


def table(hidden: int, rows: int = 5, seed: int = 0) -> PromptTable:
    generator = torch.Generator().manual_seed(seed)
    return PromptTable.of((torch.randn(rows, hidden, generator=generator) * 0.05).numpy())


def prompt(vocab: int) -> list[int]:
    """Virtual tokens first (as a p-tuning prefix is), then real ones; 21 tokens span several chunks."""
    return [vocab + i for i in range(5)] + [11, 57, 300, 12, 19, 4, 88, 5, 91, 102, 33, 7, 64, 8, 2, 31]


def hf_reference(model_dir, ids: list[int], t: PromptTable) -> tuple[np.ndarray, list[int]]:
    """transformers with inputs_embeds: the model's embeddings, table rows at the virtual ids."""
    model = load_hf(model_dir, torch.float32)
    vocab = model.config.vocab_size
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([[i if i < vocab else 0 for i in ids]]))
        for position, i in enumerate(ids):
            if i >= vocab:
                embeds[0, position] = torch.from_numpy(t.embeddings[i - vocab])
        logits = model(inputs_embeds=embeds).logits[0].numpy()
        out = model.generate(inputs_embeds=embeds, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    return logits, out[0, -NEW:].tolist()


def request(request_id: str, ids: list[int], t: PromptTable | None, **asked) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, **asked)
    return GenerationRequest(request_id, ids, params, prompt_table=t)


def test_prompt_table_equals_transformers_with_inputs_embeds(model_dirs):
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype="float32")
    t = table(eng.loaded.spec.hidden_size)
    ids = prompt(eng.vocab_size)
    logits, tokens = hf_reference(model_dir, ids, t)
    eng.add_request(request("p", ids, t, return_context_logits=True))
    outputs = eng.run_to_completion()["p"]
    np.testing.assert_allclose(outputs[0].context_logits, logits, atol=1e-4, rtol=0)
    assert outputs[-1].output_token_ids == tokens


def test_the_table_is_in_the_prefix_cache_key(model_dirs):
    """The same ids with another table (or none) are another prompt: no prefix hit, other tokens."""
    model_dir = model_dirs["llama"]
    eng = engine(model_dir, dtype="float32", enable_prefix_caching=True)
    hidden, ids = eng.loaded.spec.hidden_size, prompt(eng.vocab_size)
    first = eng.generate([request("a", ids, table(hidden, seed=0))])["a"]
    hits = eng.blocks.prefix_hits
    again = eng.generate([request("b", ids, table(hidden, seed=0))])["b"]
    assert eng.blocks.prefix_hits > hits and again.output_token_ids == first.output_token_ids  # same table: hit
    hits = eng.blocks.prefix_hits
    other = eng.generate([request("c", ids, table(hidden, seed=1))])["c"]
    assert eng.blocks.prefix_hits == hits and other.output_token_ids != first.output_token_ids
    _, tokens = hf_reference(model_dir, ids, table(hidden, seed=1))
    assert other.output_token_ids == tokens


def test_prompt_table_across_prefill_and_decode(model_dirs):
    model_dir = model_dirs["llama"]
    prefill_engine, decode_engine = engine(model_dir, dtype="float32"), engine(model_dir, dtype="float32")
    t = table(prefill_engine.loaded.spec.hidden_size)
    ids = prompt(prefill_engine.vocab_size)
    r = request("pd", ids, t)
    first = prefill_engine.prefill([r])["pd"]
    final = decode_engine.decode([(r, first.prefill)])["pd"]
    assert final.output_token_ids == hf_reference(model_dir, ids, t)[1]


def test_table_mistakes_name_the_field(model_dirs):
    eng = engine(model_dirs["llama"], dtype="float32")
    hidden, vocab = eng.loaded.spec.hidden_size, eng.vocab_size
    with pytest.raises(ValueError, match="^prompt_token_ids: token id"):
        eng.validate(request("x", [vocab + 5, 3], table(hidden, rows=5)))  # past the table
    with pytest.raises(ValueError, match="^prompt_token_ids: token id"):
        eng.validate(request("x", [vocab, 3], None))  # no table: past the vocabulary
    with pytest.raises(ValueError, match="^prompt_embedding_table: shape"):
        eng.validate(request("x", [vocab, 3], table(hidden + 1)))
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        eng.validate(request("x", [vocab, 3], table(hidden), prompt_logprobs=1), Mode.GENERATE)
