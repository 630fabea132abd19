"""Streaming decoded text token by token, without splitting a character and without re-decoding.

A byte-level tokenizer may spread one character over several tokens (a Cyrillic letter, an
emoji or a rare CJK ideograph that its vocabulary lacks whole). Decoding the tokens generated so
far then ends in U+FFFD, the replacement character, until the token that completes the
character arrives. :class:`IncrementalDecoder` holds such a tail back, as transformers'
``TextStreamer`` and vLLM's detokenizer do, so a stream of deltas adds up to the final decode;
and, as vLLM's detokenizer does, it decodes only a short window of the latest tokens at each
step, so streaming an answer costs time linear in its length.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REPLACEMENT", "IncrementalDecoder"]

#: U+FFFD, what a decoder gives for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """The new text of each token of a growing sequence, whole characters only.

    Feed :meth:`push` every generated token; it returns the text not sent before, minus a
    trailing run of U+FFFD (a character still incomplete), which a later push sends once a token
    completes it. :meth:`flush` at the end sends whatever is held back, U+FFFD included when the
    sequence really ends inside a character.

    Each push decodes a *window* of the latest tokens: the tokens since the last push whose
    decode ended on a whole character, after the last token of that push as context (a
    SentencePiece decoder drops the leading space of a decode's first token, and a clean-up of
    spaces looks at the text before; both decodes that are compared start at the same token, so
    the drop cancels). The deltas concatenate to the decode of the whole sequence as long as
    decoding is concatenative across those windows, which holds for byte-level BPE and
    SentencePiece decoders.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        skip_special_tokens: passed to ``decode`` (special tokens add no text).

    Attributes:
        ids: every token pushed.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._start = 0  # the window is ids[_start:]
        self._sent = 0  # characters of the window's decode already returned

    def _decode(self, start: int) -> str:
        return self.tokenizer.decode(self.ids[start:], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Take the next token; return its new complete characters (may be ``""``)."""
        self.ids.append(int(token_id))
        window = self._decode(self._start)
        end = len(window.rstrip(REPLACEMENT))
        delta = window[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        if end == len(window) and self._start < len(self.ids) - 1:
            # every token so far is sent: the next window keeps only the last one, as context
            self._start = len(self.ids) - 1
            self._sent = len(self._decode(self._start))
        return delta

    def flush(self) -> str:
        """The held-back tail (``""`` if none): call once the sequence ends."""
        window = self._decode(self._start)
        delta = window[self._sent:]
        self._sent = len(window)
        return delta
