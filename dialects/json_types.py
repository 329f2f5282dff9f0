"""What the API's schemas (MindIE's and OpenAI's dialects) share."""

from __future__ import annotations

import json
from typing import Annotated

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


class StrictModel(BaseModel):
    """Unknown fields are refused; types are strict (no "5" for 5, no true for 1), except that
    an integer may come as 107.0, as JSON Schema's integer allows."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data):
        return _integral(data)


def only(*values, description: str) -> WithJsonSchema:
    """The schema of a field whose other values are refused with a 400 that says why: it lists
    the accepted ones, so a schema-driven client never builds a request that is refused."""
    return WithJsonSchema({"enum": list(values), "description": description})
