"""The embedded default model ``tiny-llama``: a small Llama with random weights.

Made deterministically (fixed seed, a byte-level BPE tokenizer trained on the corpus
below), in about a second, into ``$PDSERVE_CACHE`` (default ``~/.cache/pdserve``). Its text
is gibberish by design: it exists so that the server, the tests and the benchmarks run
with nothing downloaded. Serve a real model by passing its directory as ``model``.
"""

from __future__ import annotations

import os
from pathlib import Path
import shutil
import tempfile

import torch

VERSION = "v2"  # v2: the chat template renders tools and tool calls
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
# Hermes' tool-call syntax, as Qwen2.5/3 and Hermes models write it (dialects/tool_calls.py
# parses it): the tools' signatures in a system block, each call as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>. Without tools, the same text as v1.
CHAT_TEMPLATE = (  # transformers trims the newline after a block tag: those newlines are {{ nl }}
    "{% set nl = '\\n' %}{{ bos_token }}"
    "{% if tools %}<|system|>\nYou may call functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}{{ nl }}{% endfor %}</tools>\n"
    "To call one, answer <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>{{ nl }}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['content'] %}{{ message['content'] }}"
    "{% endif %}{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% if not loop.first or message['content'] %}{{ nl }}{% endif %}"
    "<tool_call>\n{\"name\": {{ call.function.name | tojson }}, \"arguments\": "
    "{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}"
    "{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}{% endif %}{{ nl }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Text the tokenizer learns from: several scripts, so that tokens split multi-byte characters.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine batches requests continuously.
Prefill computes the prompt; decode produces one token per step for every running request.
The key-value cache is split into blocks of sixteen tokens, taken and given back as requests grow and end.
Priority one is served before priority five; within a level, the first to arrive goes first.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Grüße aus Köln, schönes Wetter heute.
Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.
大语言模型推理服务将预填充和解码分开部署,键值缓存通过对象存储传输。
请求的优先级从一到五,数值越小优先级越高。每个请求都有超时时间。
東京の天気は晴れです。今日はいい日ですね。
Съешь же ещё этих мягких французских булок, да выпей чаю.
Emoji travel too: 🚀 🌍 ✨ 🤖 — and so do dashes, “quotes” and ellipses…
def generate(prompt, max_new_tokens=20): return engine.step() for _ in range(max_new_tokens)
{"input_id": [5618, 19678, 701, 9072, 13], "stream": false, "parameters": {"temperature": 0.5}}
"""


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def ensure_tiny_model() -> Path:
    """The tiny-llama directory in the cache, made on first use."""
    target = cache_root() / f"tiny-llama-{VERSION}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-llama-"))
        make_tiny_model(staging)
        try:
            staging.rename(target)  # atomic: a concurrent maker either wins or finds it made
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def make_tiny_model(directory: str | Path) -> Path:
    """Write tiny-llama to ``directory`` as an ordinary Hugging Face model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(directory)
    return directory


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", chat_template=CHAT_TEMPLATE)
