"""Speculative decoding: decode tokens per second with drafts against without, in one run.

Model: SmolLM-135M's shape cut to 8 layers (benchmarks/engine_throughput.py), random weights,
greedy, every request to ``--output-len`` tokens. Decode throughput counts the tokens after
each request's first and the time from the step that gave every request its first token to
the end; the prompts are computed in the steps before it and not counted.

Rows, each against ``off`` (plain decoding) on the same prompts:
- ``perfect k=4``: every step verifies the next 4 tokens of the request's own output (known from
  the plain run): the best case of 4-token drafts, 5 tokens a step.
- ``stand j of 4``: the first j drafts right, the rest wrong: throughput against accepted tokens
  per step. The cost of a step does not depend on what the tokens mean, so this row gives the
  speed-up of any drafter (prompt lookup on a real model) from its acceptance.
- ``prompt lookup``: the engine's own drafter on a text-editing workload (a document, then the
  request to repeat it with an edit: the prompt holds the text the output should copy).
  A random model does not copy its context, so its acceptance here is low; the row measures the
  drafter's overhead when it is wrong, and reports the acceptance it saw.
Perfect and partial drafts come from a benchmark-only oracle that stands in for the drafter.

    python benchmarks/speculative.py [--requests 1 8] [--output-len 64] [--json PATH]
"""

from __future__ import annotations

import json
from pathlib import Path
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from benchmarks.engine_throughput import SMOLLM_8L, make_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from engine.decoding.speculative import NO_DRAFTS, StepDrafts  # noqa: E402
from sampling import SamplingParams  # noqa: E402

K = 4


def prompts(count: int, length: int, editing: bool) -> list[list[int]]:
    """Random token prompts; ``editing``: a document of length - 24 tokens, then its first 24 again
    (the model is asked to go on copying it)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        if editing:
            doc = torch.randint(3, SMOLLM_8L["vocab_size"], (length - 24,), generator=generator).tolist()
            out.append(doc + doc[:24])
        else:
            out.append(torch.randint(3, SMOLLM_8L["vocab_size"], (length,), generator=generator).tolist())
    return out


class Oracle:
    """Drafts from the known output: the first ``right`` of each K correct, the rest wrong."""

    def __init__(self, outputs: dict[str, list[int]], right: int) -> None:
        self.outputs, self.right = outputs, right

    def __call__(self, seq, room: int) -> StepDrafts:
        done = seq.num_output_tokens
        upcoming = self.outputs[seq.request_id][done:done + min(K, room)]
        if not upcoming:
            return NO_DRAFTS
        return StepDrafts([t if j < self.right else (t + 1) % SMOLLM_8L["vocab_size"]
                           for j, t in enumerate(upcoming)])


def timed_run(engine: LLMEngine, ids: list[list[int]], output_len: int, **fields) -> tuple[float, dict]:
    """(decode seconds, each request's output ids)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(GenerationRequest(f"r{i}", prompt, params, **fields))
    outputs, started = {}, None
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if started is None and len(outputs) == len(ids):
            started = time.perf_counter()
    assert all(len(o) == output_len for o in outputs.values()) and engine.blocks.counts().held == 0
    return time.perf_counter() - started, outputs


def measure(engine: LLMEngine, ids: list[list[int]], output_len: int, label: str, baseline: float | None,
            plain: dict | None, **fields) -> dict:
    drafter = engine.drafter
    before = (drafter.num_drafts, drafter.num_draft_tokens, drafter.num_accepted_tokens)
    seconds, outputs = timed_run(engine, ids, output_len, **fields)
    if plain is not None:
        assert outputs == plain, f"{label}: the output changed"
    drafts, drafted, accepted = (now - then for now, then in zip(
        (drafter.num_drafts, drafter.num_draft_tokens, drafter.num_accepted_tokens), before))
    tokens = len(ids) * (output_len - 1)
    row = {"requests": len(ids), "mode": label, "decode_s": round(seconds, 3),
           "decode_tok_s": round(tokens / seconds, 1),
           "speedup": round(baseline / seconds, 2) if baseline else 1.0,
           "accepted_per_step": round(accepted / drafts, 2) if drafts else 0.0,
           "tokens_per_step": round(1 + accepted / drafts, 2) if drafts else 1.0,
           "acceptance": round(accepted / drafted, 3) if drafted else None}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "smollm-8l")
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory_gb=1.0,
                                        max_draft_tokens=K))
        own_drafter = engine.drafter.propose
        timed_run(engine, prompts(1, 32, False), 8)  # warm
        for count in args.requests:
            for editing in (False, True):
                ids = prompts(count, args.input_len, editing)
                kind = "editing" if editing else "random"
                engine.drafter.propose = own_drafter
                off = measure(engine, ids, args.output_len, f"{kind}: off", None, None)
                _, plain = timed_run(engine, ids, args.output_len)
                base = off["decode_s"]
                if not editing:
                    for right in (K, 3, 2, 1, 0):
                        engine.drafter.propose = Oracle(plain, right)
                        label = "perfect k=4" if right == K else f"stand {right} of 4"
                        rows.append(measure(engine, ids, args.output_len, label, base, plain))
                    engine.drafter.propose = own_drafter
                rows.append(off)
                rows.append(measure(engine, ids, args.output_len, f"{kind}: prompt lookup", base, plain,
                                    prompt_lookup=True))
    write_json(args.json, {"args": arguments(args), "rows": rows})


if __name__ == "__main__":
    main()
