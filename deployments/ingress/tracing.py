"""One trace per request: its id, its phase times, one log line, histograms and OpenTelemetry spans.

The request id is the HTTP request's ``x-request-id``: the client's, or the one Ray Serve's
proxy makes; the proxy returns it in the response's ``x-request-id`` header and carries it to
every replica the request reaches (P's and D's log lines name it). The engine request's own
id (``infer-...``, ``chatcmpl-...``) stays unique per engine whatever the client sends.

Phases of one engine request (wall-clock seconds; each engine's clock, compared across the
machines of one cluster):

    ingress arrival ─ queue{ingress} ─ engine arrival ─ queue{prefill} ─ scheduled ─ prefill ─ first token
      PD: ─ queue{decode} ─ D scheduled (blocks held for the KV) ─ kv transfer (D fetches it) ─ ... ─ last token
    decode = first token to last token (vLLM's definition; in PD it holds the transfer and D's queue)

A trace is ended once, by its request flow (deployments/ingress/request_flow.py: the request ends,
fails, or its client goes away).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
import logging
import time

from engine.outputs import RequestOutput

logger = logging.getLogger("ray.serve." + __name__)  # Serve's handlers add the request id to each line


@dataclass
class KVTransfer:
    """D's fetch of one request's KV from the object store."""

    nbytes: int
    start: float  # time.time()
    end: float


@dataclass
class EngineTimes:
    """An engine's clock for one request: arrival, first scheduled, first token (from its first output)."""

    arrival: float | None
    scheduled: float | None
    first_token: float | None

    @classmethod
    def of(cls, output: RequestOutput) -> "EngineTimes":
        return cls(output.arrival_time, output.scheduled_time, output.first_token_time)


@dataclass
class RequestTrace:
    """What the ingress learns about one engine request as its outputs pass (``record_*``)."""

    request_id: str  # x-request-id
    engine_request_id: str
    dialect: str  # "mindie" or "openai"
    priority: int
    prompt_tokens: int
    arrival: float = field(default_factory=time.time)
    prefill: EngineTimes | None = None  # P, or the colocated engine
    decode: EngineTimes | None = None  # D
    kv: KVTransfer | None = None
    first_token: float | None = None  # at the ingress
    last_token: float | None = None
    last_gap: float = 0.0  # seconds between the last two outputs with tokens
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    migrations: int = 0  # times it moved to another replica after one failed (deployments/ingress/migration.py)

    def record_prefill(self, output: RequestOutput) -> None:
        if self.prefill is None:
            self.prefill = EngineTimes.of(output)

    def record_decode(self, output: RequestOutput) -> None:
        if self.decode is None:
            self.decode = EngineTimes.of(output)

    def record_kv(self, transfer: KVTransfer) -> None:
        self.kv = transfer

    def record_output(self, output: RequestOutput) -> None:
        """Every output, at the ingress, in order."""
        if output.new_token_ids:
            now = time.time()
            self.first_token = self.first_token or now
            self.last_gap = now - (self.last_token or now)
            self.last_token = now
            self.output_tokens += len(output.new_token_ids)
        if output.finished and output.finish_reason:
            self.finish_reasons.append(output.finish_reason)

    def intervals(self) -> dict[str, tuple[float, float]]:
        """(start, end) of each phase this request went through, in order."""
        p, d, kv = self.prefill, self.decode, self.kv
        spans = {
            "queue_ingress": (self.arrival, p and p.arrival),
            "queue_prefill": (p and p.arrival, p and p.scheduled),
            "prefill": (p and p.scheduled, p and p.first_token),
            "kv_transfer": (kv and kv.start, kv and kv.end),
            "queue_decode": (d and d.arrival, d and d.scheduled),
            "decode": (self.first_token, self.last_token) if self.output_tokens > 1 else (None, None),
        }
        return {name: (start, end) for name, (start, end) in spans.items()
                if start is not None and end is not None and end >= start}

    def phases(self) -> dict[str, float]:
        """Seconds per phase reached, and the time to the first token at the ingress."""
        durations = {name: end - start for name, (start, end) in self.intervals().items()}
        if self.first_token is not None:
            durations["ttft"] = self.first_token - self.arrival
        return durations


class RecentTraces:
    """The last ``capacity`` ended traces of this ingress replica, for GET /traces/{id} (the page at
    GET / draws one request's phases from it). Bounded: the oldest is dropped first."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._ended: OrderedDict[str, dict] = OrderedDict()  # engine request id -> as_json()

    def add(self, trace: RequestTrace, outcome: str) -> None:
        self._ended[trace.engine_request_id] = as_json(trace, outcome)
        while len(self._ended) > self.capacity:
            self._ended.popitem(last=False)

    def find(self, request_id: str) -> list[dict]:
        """The engine request ``request_id``, or those of one response: its engine requests are
        named ``<response id>-<prompt index>`` (chatcmpl-…-0, cmpl-…-0, cmpl-…-1)."""
        if request_id in self._ended:
            return [self._ended[request_id]]
        found = []
        while (name := f"{request_id}-{len(found)}") in self._ended:
            found.append(self._ended[name])
        return found


def as_json(trace: RequestTrace, outcome: str) -> dict:
    """One ended trace: each phase reached as seconds from the ingress's arrival (start, end), in
    order; phases the request did not go through (KV transfer and D's queue when colocated) are
    absent, not zero."""
    return {"request_id": trace.request_id, "engine_request_id": trace.engine_request_id, "outcome": outcome,
            "prompt_tokens": trace.prompt_tokens, "output_tokens": trace.output_tokens,
            "kv_bytes": trace.kv.nbytes if trace.kv else None, "migrations": trace.migrations,
            "ttft": trace.phases().get("ttft"),
            "phases": [{"name": name, "start": start - trace.arrival, "end": end - trace.arrival}
                       for name, (start, end) in trace.intervals().items()]}


def log_line(trace: RequestTrace, outcome: str) -> None:
    """One INFO line per finished request: no prompt, no text."""
    times = " ".join(f"{k}={v * 1000:.1f}ms" for k, v in trace.phases().items())
    kv = f" kv_bytes={trace.kv.nbytes}" if trace.kv else ""
    moved = f" migrations={trace.migrations}" if trace.migrations else ""
    logger.info("request %s (%s) %s: %s priority=%d prompt_tokens=%d output_tokens=%d finish=%s %s%s%s",
                trace.request_id, trace.engine_request_id, trace.dialect, outcome, trace.priority,
                trace.prompt_tokens, trace.output_tokens, ",".join(sorted(set(trace.finish_reasons))) or "-",
                times, kv, moved)


class SpanWriter:
    """OpenTelemetry spans of finished requests: a root span per request, a child per phase,
    written after the fact with the phases' own start and end times. ``exporter``: "console"
    (JSON on the ingress's stdout, for debugging) or an SDK SpanExporter (tests)."""

    def __init__(self, exporter) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "pdserve"}))
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter() if exporter == "console" else exporter))
        self.tracer = provider.get_tracer("pdserve")

    def write(self, trace: RequestTrace, outcome: str) -> None:
        from opentelemetry.trace import set_span_in_context

        def ns(t: float) -> int:
            return int(t * 1e9)

        root = self.tracer.start_span("request", start_time=ns(trace.arrival), attributes={
            "pdserve.request_id": trace.request_id, "pdserve.engine_request_id": trace.engine_request_id,
            "pdserve.dialect": trace.dialect, "pdserve.priority": trace.priority, "pdserve.outcome": outcome,
            "gen_ai.usage.input_tokens": trace.prompt_tokens, "gen_ai.usage.output_tokens": trace.output_tokens})
        context = set_span_in_context(root)
        for name, (start, end) in trace.intervals().items():
            span = self.tracer.start_span(name, context=context, start_time=ns(start))
            if name == "kv_transfer":
                span.set_attribute("pdserve.kv_bytes", trace.kv.nbytes)
            span.end(end_time=ns(end))
        root.end(end_time=ns(time.time()))
