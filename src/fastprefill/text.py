"""Streaming decoded text without splitting a character.

A byte-level tokenizer may spread one character over several tokens (a Cyrillic letter, an
emoji or a rare CJK ideograph that its vocabulary lacks whole). Decoding the tokens generated so
far then ends in U+FFFD, the replacement character, until the token that completes the
character arrives. :class:`IncrementalText` holds such a tail back, as transformers'
``TextStreamer`` and vLLM's detokenizer do, so a stream of deltas adds up to the final decode.
"""

from __future__ import annotations

__all__ = ["REPLACEMENT", "IncrementalText"]

#: U+FFFD, what a decoder gives for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class IncrementalText:
    """The new text of each decode of a growing token sequence, whole characters only.

    Feed :meth:`push` the decode of *all* tokens so far after every token; it returns the text
    not sent before, minus a trailing run of U+FFFD (a character still incomplete), which a
    later push sends once the decode completes it. :meth:`flush` at the end sends whatever is
    held back, U+FFFD included when the sequence really ends inside a character.

    The deltas of every push and the final flush concatenate to the last decode exactly as long
    as each decode extends the text already sent, which holds for byte-level BPE and
    SentencePiece decoders: they change only an incomplete tail, and that tail is never sent.

    Attributes:
        text: the last decode pushed.
        sent: how many characters of ``text`` have been returned.
    """

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0

    def push(self, text: str) -> str:
        """Take the decode of all tokens so far; return its new complete characters (may be ``""``)."""
        self.text = text
        end = len(text.rstrip(REPLACEMENT))
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def flush(self) -> str:
        """The held-back tail of the last decode (``""`` if none): call once the sequence ends."""
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta
