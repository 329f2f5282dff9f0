"""pdserve's engine on one CUDA GPU, against transformers and against the GPU's own floors, in one run.

Prepared to run in at most 5 minutes on an H100 or H200 with torch, triton and transformers (and
the project's own pure-Python dependencies: numpy, tokenizers, safetensors, llguidance). Random
models are made by transformers on the GPU; nothing is downloaded. It reports:

1. Correctness: float32 greedy tokens of the engine (triton_paged, CUDA graphs) against
   transformers' ``generate`` on 8 prompts; in-process PD (P's KV exported, imported by a second
   engine) against the engine alone; bfloat16 tokens against transformers' bfloat16, as a share.
2. Speed, per workload (the issue's four): transformers' static-batch ``generate`` tok/s; the
   engine's tok/s end to end (its second run, on fresh prompts, so no prefix-cache hit), its
   prefill seconds (until every request has its first token) and decode ms per step after that.
3. The floors of the same GPU: one decode step at the workload's batch and mid-decode context
   (the model's GEMMs, the LM head and flash attention over contiguous K/V, captured in one CUDA
   graph), the prefill (GEMMs at every prompt row and causal flash attention), and the
   workload's floor, prefill + (output - 1) decode steps; the engine's share of each.
4. The PD hand-off from the GPU pool: a 512-token prompt's KV out to host memory and back in.
5. Where the time goes, at the largest workload: one layer's attention kernel against flash SDPA
   over contiguous K/V; GPU time by kernel (torch.profiler) over its prefill and 8 decode steps;
   a decode step's host time (cProfile of 20 steps).

    python benchmarks/gpu.py [--json PATH] [--only NAME] [--no-sweep]
"""

from __future__ import annotations

import cProfile
from dataclasses import dataclass
import io
import json
from pathlib import Path
import pstats
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli import bench_parser, write_json  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv_transfer import numpy_to_tensor, tensor_to_numpy  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from engine.execution.tiny_model import ensure_tiny_model  # noqa: E402
from sampling import SamplingParams  # noqa: E402

SMOLLM = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
              max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1,
              eos_token_id=2)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True,
                rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
SHAPES = {"smollm-8l": {**SMOLLM, "num_hidden_layers": 8}, "smollm-30l": {**SMOLLM, "num_hidden_layers": 30},
          "llama-1b": LLAMA_1B}


@dataclass
class Workload:
    shape: str
    num_prompts: int
    input_len: int
    output_len: int

    @property
    def name(self) -> str:
        return f"{self.shape} {self.num_prompts}x{self.input_len}->{self.output_len}"


WORKLOADS = [Workload("smollm-8l", 32, 128, 64), Workload("smollm-30l", 256, 256, 128),
             Workload("llama-1b", 64, 512, 128), Workload("llama-1b", 256, 512, 128)]
DEVICE = torch.device("cuda")


def say(*args) -> None:
    print(*args, flush=True)


def make_model(directory: Path, dtype: torch.dtype, **config) -> Path:
    """A random Llama-family model made on the GPU, saved with tiny-llama's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_tiny_model() / name, directory / name)
    return directory


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 30000), (n, length), generator=generator).tolist()


def engine(model_dir: Path, dtype: str, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype=dtype, device="cuda", kv_cache_memory_gb=8.0, max_num_seqs=256,
                    max_num_batched_tokens=8192, batch_invariant=False)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def hf_generate(model, ids: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    batch = torch.tensor(ids, device=DEVICE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0)
    torch.cuda.synchronize()
    return out[:, batch.shape[1]:].tolist(), time.perf_counter() - start


# 1. Correctness -------------------------------------------------------------------------------

def correctness(root: Path) -> dict:
    from transformers import AutoModelForCausalLM

    config = {**SMOLLM, "num_hidden_layers": 4}
    model_dir = make_model(root / "parity", torch.float32, **config)
    ids = prompts(8, 48, config["vocab_size"], seed=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    reference, _ = hf_generate(hf, ids, 32)
    hf_bf16 = hf.to(torch.bfloat16)
    reference_bf16, _ = hf_generate(hf_bf16, ids, 32)
    del hf, hf_bf16
    requests = [GenerationRequest(f"r{i}", p, greedy(32)) for i, p in enumerate(ids)]
    small = dict(kv_cache_memory_gb=1.0)
    alone = engine(model_dir, "float32", **small)
    assert alone.runner.attention.name == "triton_paged" and alone.runner.graphs is not None
    tokens = [alone.generate(requests)[f"r{i}"].output_token_ids for i in range(len(ids))]
    prefill, decode = engine(model_dir, "float32", **small), engine(model_dir, "float32", **small)
    firsts = prefill.prefill(requests)
    rest = decode.decode([(r, firsts[r.request_id].prefill) for r in requests])
    pd_tokens = [rest[f"r{i}"].output_token_ids for i in range(len(ids))]
    bf16 = engine(model_dir, "bfloat16", **small)
    bf16_tokens = [bf16.generate(requests)[f"r{i}"].output_token_ids for i in range(len(ids))]
    same = sum(a == b for a, b in zip(tokens, reference))
    result = {"fp32_equal_to_transformers": f"{same}/{len(ids)}",
              "pd_equal_to_alone": f"{sum(a == b for a, b in zip(pd_tokens, tokens))}/{len(ids)}",
              "bf16_tokens_equal_to_transformers_bf16": _share(bf16_tokens, reference_bf16),
              "fp32_tokens_equal_to_transformers": _share(tokens, reference)}
    say("correctness:", result)
    return result


def _share(got: list[list[int]], expected: list[list[int]]) -> str:
    """Tokens equal up to the first difference of each row, over all tokens."""
    equal = 0
    for a, b in zip(got, expected):
        for x, y in zip(a, b):
            if x != y:
                break
            equal += 1
    return f"{equal / sum(len(b) for b in expected):.1%}"


# 2. Speed ------------------------------------------------------------------------------------

def run_engine(llm: LLMEngine, ids: list[list[int]], new: int, tag: str) -> dict:
    """One run of the workload, stepped by hand: total, prefill (until every request has a
    token) and decode (the steps after) apart."""
    for i, p in enumerate(ids):
        llm.add_request(GenerationRequest(f"{tag}{i}", p, greedy(new)))
    started, have_first, tokens = set(), None, 0
    decode_steps = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while llm.has_work():
        for out in llm.step():
            tokens += len(out.new_token_ids)
            started.add(out.request_id)
        if have_first is not None:
            decode_steps += 1
        elif len(started) == len(ids):
            have_first = time.perf_counter()
    end = time.perf_counter()
    assert tokens == len(ids) * new, (tokens, len(ids) * new)
    return {"tok_s": tokens / (end - start), "seconds": end - start, "prefill_s": have_first - start,
            "decode_ms_per_step": 1e3 * (end - have_first) / max(decode_steps, 1), "decode_steps": decode_steps}


def speed(w: Workload, model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    config = SHAPES[w.shape]
    ids = prompts(w.num_prompts, w.input_len, config["vocab_size"], seed=2)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    hf_generate(hf, [p[:16] for p in ids[:2]], 2)  # warm-up
    _, hf_seconds = hf_generate(hf, ids, w.output_len)
    del hf
    torch.cuda.empty_cache()
    start = time.perf_counter()
    llm = engine(model_dir, "bfloat16")
    startup = time.perf_counter() - start
    run_engine(llm, prompts(w.num_prompts, w.input_len, config["vocab_size"], seed=3), w.output_len, "warm")
    measured = run_engine(llm, ids, w.output_len, "run")
    generated = w.num_prompts * w.output_len
    graphs = llm.runner.graphs
    result = {"hf_generate_tok_s": generated / hf_seconds, "engine": measured, "engine_startup_s": startup,
              "graph_pool_mib": graphs.pool_bytes / (1 << 20) if graphs else None,
              "engine_vs_hf": measured["tok_s"] / (generated / hf_seconds)}
    result["_engine"] = llm
    return result


# 3. Floors -----------------------------------------------------------------------------------

class FloorModel:
    """The model's weights as plain matrices, bf16, on the GPU: what a step cannot do without."""

    def __init__(self, config: dict) -> None:
        h, inter = config["hidden_size"], config["intermediate_size"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = h // self.heads
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        make = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16) * 0.02  # noqa: E731
        self.layers = [(make(q + 2 * kv, h), make(h, q), make(2 * inter, h), make(h, inter))
                       for _ in range(config["num_hidden_layers"])]
        self.lm_head = make(config["vocab_size"], h)
        self.q, self.kv = q, kv

    def decode_step(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x [B, H]; k/v_cache [B, Hkv, L, D] contiguous. GEMMs + flash attention of one decode step."""
        b = x.shape[0]
        for qkv_w, o_w, gate_up_w, down_w in self.layers:
            qkv = x @ qkv_w.t()
            q = qkv[:, :self.q].view(b, self.heads, 1, self.head_dim)
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
            x = o.reshape(b, -1) @ o_w.t()
            x = (x @ gate_up_w.t())[:, :gate_up_w.shape[0] // 2] @ down_w.t()
        return x @ self.lm_head.t()

    def prefill(self, b: int, t: int) -> None:
        x = torch.randn(b * t, self.layers[0][1].shape[0], device=DEVICE, dtype=torch.bfloat16)
        for qkv_w, o_w, gate_up_w, down_w in self.layers:
            qkv = x @ qkv_w.t()
            q = qkv[:, :self.q].view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = qkv[:, self.q:self.q + self.kv].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = qkv[:, self.q + self.kv:].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = o.transpose(1, 2).reshape(b * t, -1) @ o_w.t()
            x = (x @ gate_up_w.t())[:, :gate_up_w.shape[0] // 2] @ down_w.t()
        x[-b:] @ self.lm_head.t()


def gpu_seconds(fn, repeats: int = 10) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after two warm-ups."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def floors(w: Workload) -> dict:
    model = FloorModel(SHAPES[w.shape])
    b, context = w.num_prompts, w.input_len + w.output_len // 2
    x = torch.randn(b, model.layers[0][1].shape[0], device=DEVICE, dtype=torch.bfloat16)
    cache = [torch.randn(b, model.kv_heads, context, model.head_dim, device=DEVICE, dtype=torch.bfloat16)
             for _ in range(2)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.decode_step(x, *cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.decode_step(x, *cache)
    step = gpu_seconds(graph.replay, 20)
    prefill = gpu_seconds(lambda: model.prefill(b, w.input_len), 3)
    total = prefill + (w.output_len - 1) * step
    return {"decode_step_ms": step * 1e3, "prefill_s": prefill, "workload_tok_s": b * w.output_len / total}


# 4. The PD hand-off --------------------------------------------------------------------------

def handoff(llm: LLMEngine, tokens: int = 512) -> dict:
    """A prompt's KV out of the GPU pool to host memory (export) and back into the pool (import):
    what P and D do around the transport, timed apart."""
    runner = llm.runner
    slots = torch.arange(tokens, device=DEVICE)
    dtype = runner.kv_cache.dtype
    export_s, import_s = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        data = tensor_to_numpy(runner.kv_cache[:, :, slots])
        export_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        runner.kv_cache[:, :, slots] = numpy_to_tensor(data, dtype).to(DEVICE)
        torch.cuda.synchronize()
        import_s.append(time.perf_counter() - start)
    export, imported = sorted(export_s)[2], sorted(import_s)[2]
    return {"tokens": tokens, "mbytes": data.nbytes / 1e6, "export_ms": export * 1e3, "import_ms": imported * 1e3,
            "export_gb_s": data.nbytes / export / 1e9, "import_gb_s": data.nbytes / imported / 1e9}


# 5. Where the time goes ----------------------------------------------------------------------

def attention_layer(w: Workload, new_tokens: int, num_seqs: int):
    """One layer's triton_paged attention over ``num_seqs`` sequences of the workload's shape, each
    with ``new_tokens`` new tokens after its context, blocks of 16 scattered over the pool: a
    function that runs it, and flash SDPA's time for the same queries over contiguous K/V."""
    from benchmarks.attention import scattered_step
    from engine.execution.attention.triton_paged import TritonPagedBackend

    config = SHAPES[w.shape]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, block = config["hidden_size"] // heads, 16
    context = w.input_len + w.output_len // 2 if new_tokens == 1 else 0
    num_blocks = num_seqs * -(-(context + new_tokens) // block) + 8
    seqs, slots = scattered_step([(context, new_tokens)] * num_seqs, num_blocks, block)
    cache = [torch.randn(num_blocks * block, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
             for _ in range(2)]
    rows = num_seqs * new_tokens
    q = torch.randn(rows, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(rows, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    step = TritonPagedBackend(heads // kv_heads).prepare(slots.to(DEVICE), seqs, {None}, block, DEVICE)
    kc, vc = (torch.randn(num_seqs, kv_heads, context + new_tokens, head_dim, device=DEVICE, dtype=torch.bfloat16)
              for _ in range(2))
    qc = q.view(num_seqs, new_tokens, heads, head_dim).transpose(1, 2)
    flash = gpu_seconds(lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=new_tokens > 1,
                                                               enable_gqa=True), 20)
    return (lambda: step.attend(q, k, v, *cache, None)), flash, 2 * kc.numel() * kc.element_size()


def attention_kernel(w: Workload, sweep: bool = True) -> dict:
    """triton_paged against flash SDPA over contiguous K/V, one layer: a decode step of the
    workload (its rows, mid-decode context) and a prefill of 16 of its prompts; then the launch
    settings swept for each (keys per iteration, warps, stages), best first."""
    from engine.execution.attention import triton_paged

    result = {}
    for kind, (new_tokens, num_seqs) in {"decode": (1, w.num_prompts), "prefill": (w.input_len, 16)}.items():
        run, flash, kv_bytes = attention_layer(w, new_tokens, num_seqs)
        default = triton_paged.LAUNCH[kind]
        paged = gpu_seconds(run, 20)
        result[kind] = {"triton_paged_us": paged * 1e6, "sdpa_contiguous_us": flash * 1e6,
                        "paged_vs_contiguous": flash / paged, "kv_gb_s": kv_bytes / paged / 1e9,
                        "launch": default}
        if not sweep:
            continue
        timings = []
        for block_n in (32, 64, 128):
            for warps in ((2, 4) if kind == "decode" else (4, 8)):
                for stages in (1, 2, 3):
                    triton_paged.LAUNCH[kind] = (block_n, warps, stages)
                    try:
                        timings.append((gpu_seconds(run, 10) * 1e6, (block_n, warps, stages)))
                    except Exception as error:  # out of shared memory, say
                        timings.append((float("inf"), f"{(block_n, warps, stages)}: {type(error).__name__}"))
        triton_paged.LAUNCH[kind] = default
        result[kind]["sweep_us"] = sorted(timings, key=lambda item: item[0])[:6]
    return result


def kernel_profile(llm: LLMEngine, w: Workload) -> str:
    """torch.profiler's GPU time by kernel over the workload's prefill and 8 decode steps."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompts(w.num_prompts, w.input_len, SHAPES[w.shape]["vocab_size"], seed=5)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_engine(llm, ids, 8, "kp")
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60)



def decode_profile(llm: LLMEngine, w: Workload, steps: int = 20) -> str:
    ids = prompts(w.num_prompts, 64, SHAPES[w.shape]["vocab_size"], seed=4)
    for i, p in enumerate(ids):
        llm.add_request(GenerationRequest(f"prof{i}", p, greedy(steps + 8)))
    started = set()
    while len(started) < len(ids):  # past the prefill
        started.update(out.request_id for out in llm.step())
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.step()
    torch.cuda.synchronize()
    profiler.disable()
    while llm.has_work():
        llm.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(22)
    return text.getvalue()


def guarded(fn, *args):
    """``fn(*args)``, or where it fails {"error": ...} with the traceback printed: one broken part
    does not cost the rest of a run on a lent GPU."""
    try:
        return fn(*args)
    except Exception as error:  # reported, and the run goes on
        import traceback

        traceback.print_exc()
        return {"error": repr(error)}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--only", help="run the workloads whose name contains this")
    parser.add_argument("--no-sweep", action="store_true", help="leave out the attention kernel's launch sweep")
    args = parser.parse_args()
    import triton
    import transformers

    began = time.perf_counter()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__}
    say(report)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report["correctness"] = guarded(correctness, root)
        report["workloads"] = {}
        models: dict[str, Path] = {}
        last = None
        for w in WORKLOADS:
            if args.only and args.only not in w.name:
                continue
            if w.shape not in models:
                models[w.shape] = make_model(root / w.shape, torch.bfloat16, **SHAPES[w.shape])
            result = guarded(speed, w, models[w.shape])
            if "error" in result:
                report["workloads"][w.name] = result
                continue
            last = (result.pop("_engine"), w)
            floor = floors(w)
            torch.cuda.empty_cache()
            engine_run = result["engine"]
            result.update(floor=floor, decode_step_vs_floor=floor["decode_step_ms"] / engine_run["decode_ms_per_step"],
                          prefill_vs_floor=floor["prefill_s"] / engine_run["prefill_s"],
                          end_to_end_vs_floor=engine_run["tok_s"] / floor["workload_tok_s"])
            report["workloads"][w.name] = result
            say(f"{w.name}: engine {engine_run['tok_s']:,.0f} tok/s ({result['engine_vs_hf']:.2f}x transformers "
                f"{result['hf_generate_tok_s']:,.0f}); decode {engine_run['decode_ms_per_step']:.2f} ms/step vs floor "
                f"{floor['decode_step_ms']:.2f} ({result['decode_step_vs_floor']:.0%}); prefill "
                f"{engine_run['prefill_s']:.3f} s vs {floor['prefill_s']:.3f} ({result['prefill_vs_floor']:.0%}); "
                f"end to end {result['end_to_end_vs_floor']:.0%} of {floor['workload_tok_s']:,.0f} tok/s; "
                f"start-up {result['engine_startup_s']:.1f} s, graphs {result['graph_pool_mib']} MiB "
                f"[{time.perf_counter() - began:.0f} s]")
        if last is not None:
            llm, w = last
            report["handoff"] = guarded(handoff, llm)
            say("hand-off:", report["handoff"])
            report["attention_kernel"] = guarded(attention_kernel, w, not args.no_sweep)
            say("attention kernel, one layer:", json.dumps(report["attention_kernel"], default=str))
            say(f"GPU time by kernel ({w.name} -> 8):\n{guarded(kernel_profile, llm, w)}")
            say(f"decode step host profile ({w.name}, 20 steps):\n{guarded(decode_profile, llm, w)}")
    report["seconds"] = time.perf_counter() - began
    say(f"done in {report['seconds']:.0f} s")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
