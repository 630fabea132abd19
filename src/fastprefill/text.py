"""Streaming decoded text token by token, without splitting a character and without re-decoding.

A byte-level tokenizer may spread one character over several tokens (a Cyrillic letter, an
emoji or a rare CJK ideograph that its vocabulary lacks whole). Decoding the tokens generated so
far then ends in U+FFFD, the replacement character, until the token that completes the
character arrives. :class:`IncrementalDecoder` holds such a tail back, as transformers'
``TextStreamer`` and vLLM's detokenizer do, so a stream of deltas adds up to the final decode;
and, as vLLM's detokenizer does, it decodes only a short window of the latest tokens at each
step, so streaming an answer costs time linear in its length.

:class:`StopStrings` sits after it: it finds the first stop string in the streamed text, also
when one spans several tokens, and releases only text that cannot be the start of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["REPLACEMENT", "IncrementalDecoder", "StopStrings"]

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


class StopStrings:
    """Streamed text cut before the first stop string, never releasing part of one.

    :meth:`feed` takes each text delta (as :class:`IncrementalDecoder` gives them) and returns
    what is safe to send: everything before a stop string once one is found, and otherwise the
    text minus a tail that may be the start of one (held back until the next delta shows whether
    it is). A stop string is found wherever it lies, across any number of tokens; the search of
    each delta starts ``max(len(s)) - 1`` characters back, so it stays linear in the text.

    ``armed=False`` (before a request's ``min_tokens``, as vLLM does) releases the delta whole
    and looks for no stop string in it; once armed, a stop string must start after that text.

    Attributes:
        text: the whole text fed so far (not cut).
        stop_at: where the first stop string starts in :attr:`text` (``None``: none found).
        matched: that stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.stop_at: int | None = None
        self.matched: str | None = None
        self._sent = 0  # characters of text released
        self._start = 0  # a stop string must start here or later

    @property
    def hit(self) -> bool:
        """Whether a stop string was found (the generation should end)."""
        return self.stop_at is not None

    def feed(self, delta: str, armed: bool = True) -> str:
        """Add a delta; return the text now safe to send (may be ``""``; nothing once :attr:`hit`)."""
        if self.hit:
            return ""
        old = len(self.text)
        self.text += delta
        if not self.stops:
            return self._release(len(self.text))
        if not armed:
            self._start = len(self.text)
            return self._release(len(self.text))
        begin = max(self._start, old - self.longest + 1)
        found = [(i, s) for s in self.stops if (i := self.text.find(s, begin)) >= 0]
        if found:
            self.stop_at, self.matched = min(found)
            return self._release(self.stop_at)
        tail = self.text[max(self._start, len(self.text) - self.longest + 1):]
        held = max((k for s in self.stops for k in range(1, min(len(s), len(tail) + 1)) if tail.endswith(s[:k])),
                   default=0)
        return self._release(len(self.text) - held)

    def _release(self, end: int) -> str:
        out = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def flush(self) -> str:
        """At the end: the held-back tail if no stop string was found (else ``""``)."""
        return "" if self.hit else self._release(len(self.text))

    def cut(self, text: str) -> str:
        """``text`` (a decode of the same tokens) up to the stop string found, or whole."""
        return text if self.stop_at is None else text[: self.stop_at]
