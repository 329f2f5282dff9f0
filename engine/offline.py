"""The engine's synchronous runs, for tests, benchmarks and the CLI: add requests, step until
nothing is left, return each request's last output per choice. Plain functions over an
``LLMEngine`` (which keeps one-line methods of the same names for its callers); the servers
drive ``step`` themselves (engine/async_engine.py) and use none of this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lora_adapter import LoraAdapter
from engine.outputs import PrefillResult, RequestOutput
from engine.request import GenerationRequest, Mode

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def run_to_completion(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until no request is left; every output, grouped by request (choices interleaved)."""
    streams: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
    return streams


def final_choices(streams: dict[str, list[RequestOutput]]) -> dict[str, list[RequestOutput]]:
    """Each request's last output per choice, by choice index."""
    finals: dict[str, list[RequestOutput]] = {}
    for rid, outs in streams.items():
        last = {out.index: out for out in outs}
        finals[rid] = [last[i] for i in sorted(last)]
    return finals


def generate_choices(engine: LLMEngine, requests: list[GenerationRequest], loras: list[LoraAdapter] = ()
                     ) -> dict[str, list[RequestOutput]]:
    """Run requests together to the end; each request's last output per choice. ``loras``:
    the adapters the requests name."""
    for request in requests:
        engine.add_request(request, lora=_named(request, loras))
    return final_choices(run_to_completion(engine))


def generate(engine: LLMEngine, requests: list[GenerationRequest], loras: list[LoraAdapter] = ()
             ) -> dict[str, RequestOutput]:
    """Run requests together to the end; each request's last output (its first choice's)."""
    return _first_choices(generate_choices(engine, requests, loras))


def prefill(engine: LLMEngine, requests: list[GenerationRequest], loras: list[LoraAdapter] = ()
            ) -> dict[str, RequestOutput]:
    """PREFILL mode to the end; each request's first choice's output (``prefill`` set when it goes on)."""
    for request in requests:
        engine.add_request(request, Mode.PREFILL, lora=_named(request, loras))
    return _first_choices(final_choices(run_to_completion(engine)))


def decode(engine: LLMEngine, pairs: list[tuple[GenerationRequest, PrefillResult]], loras: list[LoraAdapter] = ()
           ) -> dict[str, RequestOutput]:
    """DECODE mode from P's results to the end; each request's first choice's output."""
    for request, prefill_result in pairs:
        engine.add_request(request, Mode.DECODE, prefill_result, lora=_named(request, loras))
    return _first_choices(final_choices(run_to_completion(engine)))


def _first_choices(finals: dict[str, list[RequestOutput]]) -> dict[str, RequestOutput]:
    """Each request's first choice's last output."""
    return {rid: outs[0] for rid, outs in finals.items()}


def _named(request: GenerationRequest, loras: list[LoraAdapter]) -> LoraAdapter | None:
    """The adapter among ``loras`` that ``request`` names, if it names one."""
    return next((a for a in loras if a.ref == request.lora), None) if request.lora is not None else None
