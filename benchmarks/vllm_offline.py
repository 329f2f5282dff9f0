"""vLLM's CPU backend on a workload given as JSON; runs inside vLLM's own venv (make bench-vllm).

    .venv-vllm/bin/python benchmarks/vllm_offline.py WORKLOAD.json

WORKLOAD: {"model": DIR, "dtype": ..., "prompts": [[ids]], "output_len": N, "max_num_seqs": N}.
Prints one line, "RESULT " and JSON: {"seconds": ..., "generated": ...} for the timed generate call (after a
warm-up call on two short prompts). It never imports pdserve: vLLM is a comparison, not a dependency.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    work = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=work["model"], dtype=work["dtype"], max_model_len=2048, max_num_seqs=work["max_num_seqs"],
              max_num_batched_tokens=2048, enable_prefix_caching=False, seed=0)
    params = SamplingParams(max_tokens=work["output_len"], min_tokens=work["output_len"], temperature=0.0,
                            ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("RESULT " + json.dumps({"seconds": seconds, "generated": generated}))


if __name__ == "__main__":
    main()
