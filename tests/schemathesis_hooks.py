"""Schemathesis hooks (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks), for the rules of the API that
no JSON Schema can state, relations between values: a completion's ``best_of`` must be at least
its ``n``; ``min_tokens`` at most the output limit; tool names are unique, a named
``tool_choice`` names one of them, a tool message answers an earlier call; a function's
``parameters`` and a ``structured_outputs.regex`` compile in the grammar engine, and grammars run
without prompt lookup; /tokenize continues a final message only when it is the assistant's;
on /infer_token, beam search's
exclusions and limits, a p-tuning table that fills its shape and matches the model, logits within
the server's size limit, draft tokens within the vocabulary and max_draft_tokens, draft logits
one row each, and LoRA tensors that go together, fit the model, and task ids the app holds; a
/v1/files upload that is UTF-8 text with a line in it.
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
                and "grammar engine" in message
                or param == "prompt_lookup" and "without drafts" in message
                or param == "min_tokens" and "must be <= the output limit" in message
                or param == "min_tokens" and "cannot be combined with" in message
                or param == "continue_final_message" and "the last message must be" in message
                or (param in ("reasoning_effort", "reasoning.effort") or param.startswith("chat_template_kwargs."))
                and "chat template" in message  # what the served model's template reads
                or _infer_token_relation(param, message) or _through_chat_relation(param, message)
                or param == "file" and error.get("code") in ("empty_file", "invalid_encoding"))  # an upload's text


def _through_chat_relation(param: str, message: str) -> bool:
    """Responses' and Anthropic's relations (dialects/responses.py, anthropic.py; Anthropic's
    errors name no ``param``): a tool output or result that answers no call, a system message
    after the input's first items, a block of the other role's, a tool_choice or tools' names; a
    thinking budget not below max_tokens, or given without type enabled; thinking (asked for, or
    sent back) to a served model that does not reason (tiny-llama), and Responses' reasoning items sent
    back to it; a thinking block in a user turn."""
    return bool("answers no earlier" in message and (param == "input" or message.startswith("messages"))
                or "budget_tokens: must be below max_tokens" in message
                or "budget_tokens: required with type 'enabled', and only with it" in message
                or "thinking: the served model does not reason" in message
                or "a thinking block, and the served model does not think" in message
                or re.fullmatch(r"input\.\d+", param) and "a reasoning item, and the served model does not" in message
                or param == "input" and "may only lead the input" in message
                or re.match(r"messages\.\d+\.content\.\d+: (tool_use|tool_result|thinking) blocks are the", message)
                or message.startswith("tool_choice.name: no tool is named")
                or re.match(r"tools\.\d+\.function\.name: .* is defined twice", message))


def _infer_token_relation(param: str, message: str) -> bool:
    """/infer_token's relations between parameters (dialects/mindie.py) that a schema cannot state."""
    beams = ("does not combine with beam search" in message or param == "stream" and "beam search" in message
             or param == "parameters.beam_width" and "max_beam_width" in message
             or param == "parameters.pad_id" and ("beam_width > 1" in message or "vocabulary" in message))
    # A check across fields says "<field>: <rule>": only such a refusal, of the field it names, is
    # a relation. A schema error on the same fields (pydantic's "Input should be ...") stands.
    named = message.startswith(f"{param}:")
    table = param.startswith(("parameters.prompt_embedding_table", "parameters.prompt_vocab_size")) and named or \
        param == "input_id" and "prompt table" in message
    logits = param in ("parameters.return_context_logits", "parameters.return_generation_logits") and \
        "max_logits_floats" in message
    drafts = param.startswith("parameters.draft_logits") and named or \
        param == "parameters.draft_input_ids" and ("max_draft_tokens" in message or "vocabulary" in message)
    # pairing, shapes against the model, ids not held
    lora = (param.startswith("parameters.lora_") or param == "lora") and named
    return beams or table or logits or drafts or lora
