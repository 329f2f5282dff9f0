"""The cost of grammar-constrained decoding: engine throughput with every request constrained (to a
JSON schema; to tool calls with ``tool_choice`` required; by the ``auto`` tool grammar, free text
unless a call begins) against the same requests unconstrained, and the time to compile each
grammar (first and cached). One run, one machine, back to back.

Model: SmolLM-135M's shape cut to 8 layers (benchmarks/engine_throughput.py), random weights, with
a byte-level BPE tokenizer of ``--vocab`` tokens trained here on random words (the mask's cost
grows with the tokenizer's vocabulary, so the tiny model's 1k tokens would flatter it). Both runs
sample at temperature 1 with the same seeds; the constrained requests end when their JSON is
complete, so throughput is output tokens per second, and the per-step time is given beside it.
The two runs also differ in what they generate (JSON against random bytes, which the detokenizer
handles at a different cost), so the mask's own cost per step is measured apart as well.

    python benchmarks/structured_output.py [--batch 32] [--vocab 32000] [--rounds 2] [--json PATH]

The tool grammars end like the schema's (a required call, one, then EOS); ``auto`` lets the
random model write text, so it runs to the length and measures what a text answer pays for
the grammar that watches for a call.
"""

from __future__ import annotations

import json
from pathlib import Path
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import SMOLLM_8L  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from dialects.tool_calls import tools_grammar  # noqa: E402
from sampling.grammar import Grammar, allowed_tokens  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "title": {"type": "string", "maxLength": 40},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 8},
        "status": {"enum": ["open", "closed", "pending"]},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                   "admin": {"type": "boolean"}},
                  "required": ["name", "admin"], "additionalProperties": False},
    },
    "required": ["id", "title", "scores", "status", "owner"],
    "additionalProperties": False,
}
# Four functions an agent might be given (Databricks allows 32, 15 properties each).
FUNCTIONS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "search": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
               "required": ["query"], "additionalProperties": False},
    "add": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"], "additionalProperties": False},
    "send_email": {"type": "object", "properties": {"to": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 40},
                                                           "minItems": 1, "maxItems": 3},
                                                    "subject": {"type": "string", "maxLength": 60},
                                                    "urgent": {"type": "boolean"}},
                   "required": ["to", "subject"], "additionalProperties": False},
}
GRAMMARS = {
    "json_schema": Grammar("json_schema", json.dumps(SCHEMA)),
    "tools_required": tools_grammar(FUNCTIONS, "required", parallel=False),
    "tools_auto": tools_grammar(FUNCTIONS, "auto", parallel=True),
}


def make_model(directory: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789{}[]\":,. " "éüßабвгдежзαβγδ的一是不了人我在有他这"
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9))) for _ in range(400_000)]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((" ".join(words[i:i + 50]) for i in range(0, len(words), 50)), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM_8L)).save_pretrained(directory)
    return directory


def run(engine: LLMEngine, batch: int, grammar: Grammar | None, max_new_tokens: int) -> dict:
    requests = [GenerationRequest(f"r{i}", [1] + list(range(100 + i, 132 + i)), SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0, seed=i + 1, grammar=grammar, ignore_eos=grammar is None))
        for i in range(batch)]
    for request in requests:
        engine.add_request(request)
    steps, outputs, start = 0, {}, time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    tokens = sum(map(len, outputs.values()))
    return {"output_tokens": tokens, "steps": steps, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ms_per_step": 1000 * seconds / steps, "outputs": list(outputs.values())}


def mask_cost_ms(engine: LLMEngine, grammar: Grammar, outputs: list[list[int]], repeats: int = 20) -> dict:
    """The mask's own cost for one step of the batch: each request's matcher halfway through its
    output computes its bitmask (host), then the batch is unpacked and applied to [B, V] logits."""
    matchers = [engine.grammars.matcher(grammar, ids[: len(ids) // 2]) for ids in outputs]
    start = time.perf_counter()
    for _ in range(repeats):
        bitmask = torch.stack([engine.grammars.bitmask(m) for m in matchers])  # [B, W]
    fill = (time.perf_counter() - start) / repeats
    logits = torch.randn(len(outputs), SMOLLM_8L["vocab_size"])
    rows = torch.arange(len(outputs))
    start = time.perf_counter()
    for _ in range(repeats):
        logits[rows] = logits[rows].masked_fill(~allowed_tokens(bitmask, logits.shape[1]), -float("inf"))
    apply = (time.perf_counter() - start) / repeats
    return {"fill_bitmasks_ms": 1000 * fill, "apply_ms": 1000 * apply}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.vocab)
        engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=args.batch,
                                        max_num_batched_tokens=max(2048, args.batch * 40)))
        start = time.perf_counter()
        engine.grammars.tokenizer()
        tokenizer_ms = 1000 * (time.perf_counter() - start)
        compile_ms = {}
        for name, grammar in GRAMMARS.items():
            compile_ms[name] = []
            for _ in range(2):  # first: compiled; second: the cache
                start = time.perf_counter()
                engine.grammars.check(grammar)
                compile_ms[name].append(1000 * (time.perf_counter() - start))
        run(engine, args.batch, None, 8)  # warm-up
        runs = {name: [] for name in ["unconstrained", *GRAMMARS]}
        for _ in range(args.rounds):  # alternated, so that drift in the machine's speed hits all alike
            runs["unconstrained"].append(run(engine, args.batch, None, args.max_new_tokens))
            for name, grammar in GRAMMARS.items():
                runs[name].append(run(engine, args.batch, grammar, args.max_new_tokens))
        mask = {name: mask_cost_ms(engine, grammar, runs[name][-1]["outputs"]) for name, grammar in GRAMMARS.items()}
    for rs in runs.values():
        for r in rs:
            del r["outputs"]
    rate = {name: sum(r["tokens_per_s"] for r in rs) / len(rs) for name, rs in runs.items()}
    step_ms = sum(r["ms_per_step"] for r in runs["unconstrained"]) / len(runs["unconstrained"])
    result = {
        "batch": args.batch, "vocab": args.vocab, "model_vocab": SMOLLM_8L["vocab_size"],
        "threads": torch.get_num_threads(), "tokenizer_ms": tokenizer_ms, "compile_ms_first_cached": compile_ms,
        **runs, "throughput_ratio": {name: rate[name] / rate["unconstrained"] for name in GRAMMARS},
        "mask_per_step": mask,
        "mask_share_of_unconstrained_step": {name: sum(m.values()) / step_ms for name, m in mask.items()},
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
