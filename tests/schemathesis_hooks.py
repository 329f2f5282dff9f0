"""Schemathesis hooks (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks), for the rules of the API that
no JSON Schema can state, relations between values: a completion's ``best_of`` must be at least
its ``n``; tool names are unique, a named ``tool_choice`` names one of them, a tool message
answers an earlier call; a function's ``parameters`` and a ``structured_outputs.regex`` compile in
the grammar engine.
Their 400s are dropped from the failures; every other failure stands."""

import json
import re

import schemathesis


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    if response is None or response.status_code != 400:
        return True
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return True
    param, message = error.get("param") or "", error.get("message", "")
    return not (param == "best_of" and message.startswith("best_of: must be >= n")
                or re.fullmatch(r"tools\.\d+\.function\.name", param) and "is defined twice" in message
                or param == "tool_choice.function.name" and "no tool is named" in message
                or re.fullmatch(r"messages\.\d+\.tool_call_id", param) and "answers no earlier" in message
                or (re.fullmatch(r"tools\.\d+\.function\.parameters", param) or param == "structured_outputs.regex")
                and "grammar engine" in message)
