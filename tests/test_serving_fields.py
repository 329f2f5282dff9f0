"""The serving extensions (priority, timeout, ignore_eos) have one owner (dialects/serving_fields.py):
every dialect's request takes them with the engine's range and defaults."""

import pytest

from dialects.anthropic_schema import MessagesRequest
from dialects.mindie import InferParameters
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest
from dialects.responses_schema import ResponsesRequest
from engine.config import EngineConfig
from engine.request import PRIORITY_MAX, PRIORITY_MIN

SCHEMAS = [InferParameters, ChatCompletionRequest, CompletionRequest, MessagesRequest, ResponsesRequest]


def bounds(schema, name: str) -> dict:
    return {k: v for k, v in schema.model_json_schema()["properties"][name].items() if k != "description"}


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_each_dialect_takes_the_engines_priority_and_timeout(schema):
    assert schema.model_fields["priority"].default == PRIORITY_MAX
    lowest = 0 if schema in (ChatCompletionRequest, CompletionRequest) else PRIORITY_MIN  # vLLM's 0: the default
    assert bounds(schema, "priority") == {"default": PRIORITY_MAX, "minimum": lowest, "maximum": PRIORITY_MAX,
                                          "type": "integer", "title": "Priority"}
    assert schema.model_fields["timeout"].default == EngineConfig.default_timeout_s
    assert bounds(schema, "timeout")["exclusiveMinimum"] == 0


@pytest.mark.parametrize("schema", [InferParameters, ChatCompletionRequest, CompletionRequest],
                         ids=lambda s: s.__name__)
def test_ignore_eos_is_off_unless_asked(schema):
    assert schema.model_fields["ignore_eos"].default is False
