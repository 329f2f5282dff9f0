"""The ``pdserve`` command: make the tiny model, convert a GGUF file ahead of serving, or generate
from the command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="write the embedded tiny-llama to DIR")
    tiny.add_argument("directory")

    convert = commands.add_parser("convert-gguf", help="dequantize a .gguf FILE into pdserve's model cache now "
                                  "(else the first start does it) and print the directory")
    convert.add_argument("file")
    convert.add_argument("--dtype", default="auto", help="the serving dtype the copy is made for")

    gen = commands.add_parser("generate", help="generate a completion for PROMPT with the engine in-process")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="tiny-llama", help="a local model directory, a .gguf file or tiny-llama")
    gen.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU or GPU has it), float32, ...")
    gen.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--attention-backend", default="auto", help="auto, torch_sdpa or cpu_paged")
    gen.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                     help="output independent of batching and chunking (docs/sampling.md); "
                          "default: on on the CPU, but in fp16, and in bf16 with quantized weights, on AMX or "
                          "AVX512-BF16 CPUs (docs/sampling.md)")
    gen.add_argument("--quantization", default=None, choices=["dequantize", "int8"],
                     help="unset: a .gguf keeps its quantized types; dequantize: every weight in --dtype; "
                          "int8: a Hugging Face checkpoint's linear weights as int8 (docs/serving.md)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)

    args = parser.parse_args(argv)
    if args.command == "make-tiny-model":
        from engine.execution.tiny_model import make_tiny_model

        print(make_tiny_model(args.directory))
        return 0
    if args.command == "convert-gguf":
        return _convert_gguf(args)
    return _generate(args)


def _convert_gguf(args: argparse.Namespace) -> int:
    from engine.execution.gguf import find_gguf
    from engine.execution.loader import resolve_model_dir, torch_dtype

    try:
        if find_gguf(args.file) is None:
            raise ValueError(f"model: {args.file!r} is not a .gguf file nor a directory holding one")
        print(resolve_model_dir(args.file, torch_dtype(args.dtype)))
    except ValueError as error:
        print(f"pdserve: {error}", file=sys.stderr)
        return 2
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import GenerationRequest
    from sampling import SamplingParams

    try:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                        enable_prefix_caching=not args.no_prefix_caching,
                                        attention_backend=args.attention_backend,
                                        batch_invariant=args.batch_invariant, quantization=args.quantization))
        prompt_ids = engine.tokenizer.encode(args.prompt)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        engine.add_request(GenerationRequest("cli", prompt_ids, params))
    except ValueError as error:
        print(f"pdserve: {error}", file=sys.stderr)
        return 2
    while engine.has_work():
        for output in engine.step():
            print(output.new_text, end="", flush=True)
            if output.finished:
                print(f"\n[finish_reason={output.finish_reason} tokens={output.num_output_tokens} "
                      f"seed={output.seed}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
