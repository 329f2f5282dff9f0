"""What the API's schemas (MindIE's and OpenAI's dialects) share."""

from __future__ import annotations

from dataclasses import dataclass
import functools
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema, model_validator

from sampling.params import MAX_SEED

# Characters that Python's str.splitlines (and so httpx's iter_lines, and clients built on it) takes
# for line ends, besides \n and \r, which JSON always escapes: escaped too, so that an event of
# generated text never splits in two.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def sse_event(body: dict) -> str:
    """One server-sent event of JSON: non-ASCII text as itself, every line-break character escaped."""
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


# uint64 in (0, 2^64 - 1]; dialects/openapi_doc.py writes its bound exactly.
Seed = Annotated[StrictInt, Field(gt=0, le=MAX_SEED)]
TokenId = Annotated[StrictInt, Field(ge=0)]  # the vocabulary's bound is the served model's


# Element types that need no conversion: a list of only these (token ids, texts) is passed
# as it is, after a type scan that runs in C (a 64 x 4096 token-id prompt: ~10 ms, not ~85).
_SCALARS = {int, str, bool, type(None)}


def _integral(value):
    """Numbers with no fractional part as ints, in nested lists and objects too."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        if set(map(type, value)) <= _SCALARS:
            return value
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


@dataclass(slots=True)
class Only(WithJsonSchema):
    """``only()``'s mark on a field: its accepted values, and why others are refused."""

    values: tuple = ()
    refusal: str = ""


def only(*values, description: str, refusal: str | None = None) -> Only:
    """A field refused unless its value is one of ``values`` (null, or its "off" value): a 400
    "<field>: <refusal>" (``refusal`` defaults to ``description``), enforced by every StrictModel.
    Its schema lists the accepted values, so a schema-driven client never builds a request that is refused."""
    return Only({"enum": list(values), "description": description}, values=values, refusal=refusal or description)


class StrictModel(BaseModel):
    """Unknown fields are refused; types are strict (no "5" for 5, no true for 1), except that
    an integer may come as 107.0, as JSON Schema's integer allows. A field marked ``only()`` is
    refused unless it has one of its accepted values."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data):
        return _integral(data)

    @model_validator(mode="after")
    def _only_accepted(self):
        for name, rule in _only_fields(type(self)):
            if not _accepted(getattr(self, name), rule.values):
                raise ValueError(f"{name}: {rule.refusal}")
        return self


def check_stream_options(stream_options: BaseModel | None, stream: bool) -> None:
    """OpenAI's rule, on chat, completions and responses alike: stream_options needs a stream."""
    if stream_options is not None and not stream:
        raise ValueError("stream_options: only allowed when stream is true")


@functools.cache
def _only_fields(model: type[BaseModel]) -> list[tuple[str, Only]]:
    return [(name, rule) for name, field in model.model_fields.items() for rule in field.metadata
            if isinstance(rule, Only)]


def _accepted(value: Any, values: tuple) -> bool:
    """``value`` is one of ``values`` by type as well (0 is not False)."""
    return any(type(value) is type(v) and value == v for v in values)
