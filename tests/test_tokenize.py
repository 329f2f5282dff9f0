"""vLLM's /tokenize and /detokenize without a server: a prompt tokenizes as completions tokenize
it, messages as chat templates them (the same ids a chat request sends the engine), and the
ids decode back; refusals name their field. tests/test_api_openai.py calls the routes over HTTP."""

import time

import pydantic
import pytest
from transformers import AutoTokenizer

from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest
from dialects.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from engine.execution.tiny_model import ensure_tiny_model

MODEL = "tiny-llama"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße aus Köln"}]


@pytest.fixture(scope="module")
def front():
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    return OpenAIFrontend(tokenizer, MODEL, len(tokenizer), 2048, 64)


def test_a_prompt_tokenizes_as_completions_do(front):
    answer = tokenize(front, TokenizeRequest(prompt="Hello there", return_token_strs=True))
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": "Hello there"})
    sent = front.completion_choices(body, "c", time.time() + 60)[0].request.prompt_token_ids
    assert answer["tokens"] == sent and answer["tokens"][0] == front.tokenizer.bos_token_id
    assert answer["count"] == len(sent) and answer["max_model_len"] == 2048
    assert answer["token_strs"] == front.tokenizer.convert_ids_to_tokens(sent) and answer["token_strs"][0] == "<s>"
    bare = tokenize(front, TokenizeRequest(prompt="Hello there", add_special_tokens=False))
    assert bare["tokens"] == sent[1:] and bare["token_strs"] is None


def test_messages_tokenize_as_chat_sends_them(front):
    answer = tokenize(front, TokenizeRequest(model=MODEL, messages=MESSAGES))
    chat = ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES})
    assert answer["tokens"] == front.chat_choices(chat, "c", time.time() + 60)[0].request.prompt_token_ids
    without = tokenize(front, TokenizeRequest(messages=MESSAGES, add_generation_prompt=False))
    assert without["count"] < answer["count"] and answer["tokens"][:without["count"]] == without["tokens"]


def test_detokenize_inverts_tokenize(front):
    ids = tokenize(front, TokenizeRequest(prompt="Grüße aus Köln", add_special_tokens=False))["tokens"]
    assert detokenize(front, DetokenizeRequest(tokens=ids)) == {"prompt": "Grüße aus Köln"}
    assert detokenize(front, DetokenizeRequest(tokens=[front.tokenizer.bos_token_id]))["prompt"] == "<s>"
    with pytest.raises(APIError) as error:
        detokenize(front, DetokenizeRequest(tokens=[5, front.vocab_size]))
    assert error.value.status == 400 and error.value.param == "tokens.1"


def test_a_model_not_served_is_a_404(front):
    with pytest.raises(APIError) as error:
        tokenize(front, TokenizeRequest(model="other", prompt="x"))
    assert error.value.status == 404 and error.value.param == "model"


@pytest.mark.parametrize("fields, field", [
    ({}, "prompt"),
    ({"prompt": "x", "messages": MESSAGES}, "prompt"),
    ({"prompt": "x", "continue_final_message": True}, "continue_final_message"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),  # the last message is the user's
    ({"prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),  # the served model's template only
])
def test_refusals_name_the_field(fields, field):
    with pytest.raises(pydantic.ValidationError) as error:
        TokenizeRequest.model_validate(fields)
    assert field in str(error.value)
