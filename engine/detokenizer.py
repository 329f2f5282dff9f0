"""Incremental detokenization with stop strings.

Each new token extends the text by the difference between decoding a short window of
recent tokens with and without it (vLLM's prefix/read offsets), so a step costs O(window),
not O(length). A piece is released only when it does not end in U+FFFD, i.e. when no
multi-byte character is still incomplete. With a Rust tokenizer the two decodes are one call of
its ``DecodeStream`` (the same offsets, kept in Rust: a third of the per-token cost); where the
stream refuses a window (its "invalid prefix": the longer decode does not extend the shorter),
the detokenizer goes on in Python from the same offsets. When the request finishes, the tail is
reconciled with one full ``decode``, so the released pieces concatenate to exactly
``tokenizer.decode(output_ids)`` (cut before a stop string when one matched, or after it).

While stop strings are set, the last ``len(longest stop) - 1`` characters are held back:
they might be the start of a stop string, which must never reach the client. With
``keep_stop`` (vLLM's include_stop_str_in_output) the text ends with the stop string that
matched instead of before it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT_CHAR = "\ufffd"


def backend_tokenizer(tokenizer: PreTrainedTokenizerBase):
    """The Rust tokenizer where its ``decode`` is all that transformers' ``decode`` would do (a
    TokenizersBackend that keeps its ``_decode`` and cleans up no spaces), else None. Each token
    decodes twice; through transformers' argument handling that took ten times the Rust call
    (cProfile of decode steps at 256 rows on an H200: the engine's largest host cost per step)."""
    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer._tokenizer
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], skip_special_tokens: bool = True,
                 keep_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        # The two decodes of ``add`` in one Rust call; None: in Python (no Rust tokenizer, or refused once).
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self.stop = stop
        self.keep_stop = keep_stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (possibly past what was released)
        self.released = 0  # characters of ``text`` already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False  # a stop string matched: the text ends before it, for good

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add one token; return (the newly released text, whether a stop string matched)."""
        self.ids.append(token_id)
        if self._stream is not None:  # the Rust stream (its call inline: this runs for every row at every step)
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # it refused the window: see _stream_refused
                piece = self._stream_refused()
        else:
            piece = self._window_piece()
        if piece:
            self.text += piece
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if not self.stop:  # nothing to look for, nothing held back: the piece is released whole
            self.released = len(self.text)
            return piece or "", False
        if self._cut_at_stop():
            self.stopped = True
            return self._release(len(self.text)), True
        return self._release(len(self.text) - self.hold_back), False

    def _window_piece(self) -> str | None:
        """The text the last token completes: the decode of the window [prefix offset, end) past
        that of [prefix offset, read offset); None while a character is incomplete."""
        before = self._decode(self.ids[self._prefix_offset:self._read_offset])
        after = self._decode(self.ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            return after[len(before):]
        return None

    def _stream_refused(self) -> str | None:
        """The Rust stream computes ``_window_piece`` with the same two offsets, but refuses a
        window whose longer decode does not start with the shorter (where the Python slice takes
        the tail by length; tokenizers raises a bare Exception, "Invalid prefix encountered"):
        from then on this detokenizer decodes in Python."""
        self._stream = None
        return self._window_piece()

    def finish(self) -> str:
        """Reconcile with a full decode (unless a stop string cut the text) and release the rest."""
        if not self.stopped:
            full = self._decode(self.ids)
            if full.startswith(self.text[: self.released]):
                self.text = full
                self.stopped = self._cut_at_stop()
        return self._release(len(self.text))

    def _cut_at_stop(self) -> bool:
        # Only text not yet released can hold a new match; stop strings may straddle the boundary.
        start = max(0, self.released - self.hold_back)
        cuts = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not cuts:
            return False
        at, matched = min(cuts, key=lambda cut: cut[0])  # the earliest match; at a tie, the first listed
        self.text = self.text[: at + len(matched) if self.keep_stop else at]
        return True

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        piece = self.text[self.released:end]
        self.released = end
        return piece
