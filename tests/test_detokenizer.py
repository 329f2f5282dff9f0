"""Incremental detokenization: streamed pieces concatenate to tokenizer.decode()."""

import random

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer
from engine.execution.tiny_model import ensure_tiny_model

# Characters outside tiny-llama's corpus are split into single-byte tokens.
TEXTS = ["Grüße 大语言模型 🚀 한국어 텍스트 𝄞 done", "ab🤖\u200dcd", "Ελληνικά κείμενα ≠ ∑"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text should split a multi-byte character"
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces = [detok.add(i)[0] for i in ids] + [detok.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_incomplete_character_at_the_end_matches_decode(tokenizer):
    ids = tokenizer.encode("x🚀", add_special_tokens=False)[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces = [detok.add(i)[0] for i in ids] + [detok.finish()]
    assert "".join(pieces) == tokenizer.decode(ids)


def streamed_until_stop(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """The pieces released token by token until a stop string matches (it must), then the rest."""
    pieces, stopped = [], False
    for i in ids:
        piece, stopped = detok.add(i)
        pieces.append(piece)
        if stopped:
            break
    assert stopped
    return pieces + [detok.finish()]


def test_stop_string_is_held_back_and_cut(tokenizer):
    text = "hello wor" + "ld and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["world"])
    pieces = streamed_until_stop(detok, ids)
    assert "".join(pieces) == "hello "
    assert not any("wor" in p for p in pieces)


@pytest.mark.parametrize("stop,expected", [
    (["world"], "hello world"),
    (["and", "lo wo"], "hello wo"),  # the one that appears first in the text
    (["wor", "world"], "hello wor"),  # a tie at the same place: the first listed
])
def test_keep_stop_ends_the_text_with_the_stop_string_that_matched(tokenizer, stop, expected):
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it."""
    ids = tokenizer.encode("hello world and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=stop, keep_stop=True)
    pieces = streamed_until_stop(detok, ids)
    assert "".join(pieces) == detok.text == expected


def window_pieces(tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    """The pieces of the two-decode window (vLLM's prefix/read offsets), written out here: what
    the detokenizer's Rust stream must release token by token."""
    pieces, prefix, read = [], 0, 0
    for end in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip_special_tokens)
        after = tokenizer.decode(ids[prefix:end], skip_special_tokens=skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, end
        else:
            pieces.append("")
    return pieces


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_releases_the_windows_pieces(tokenizer, skip_special_tokens):
    # Special ids (0-2), byte tokens (3-258: split characters), any id, ids past the tokenizer's vocabulary.
    generator = random.Random(skip_special_tokens)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [generator.choice([generator.randrange(0, 3), generator.randrange(3, 259), generator.randrange(3, vocab),
                                 generator.randrange(vocab, vocab + 40)]) for _ in range(generator.randrange(1, 24))]
        detok = IncrementalDetokenizer(tokenizer, stop=[], skip_special_tokens=skip_special_tokens)
        assert [detok.add(i)[0] for i in ids] == window_pieces(tokenizer, ids, skip_special_tokens), ids
        assert detok._stream is not None  # the Rust stream released them, not the Python fallback


def test_a_window_the_stream_refuses_goes_on_in_python_from_the_same_offsets(tokenizer):
    """Where the Rust stream raises (its "invalid prefix"), that token and every later one take the
    Python window, from the offsets the stream had reached: the pieces stay the window's."""
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces = [detok.add(i)[0] for i in ids[:7]]

    class Refusing:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered")

    detok._stream = Refusing()
    pieces += [detok.add(i)[0] for i in ids[7:]]
    assert detok._stream is None
    assert pieces == window_pieces(tokenizer, ids, True)
    assert "".join(pieces) + detok.finish() == TEXTS[0]
