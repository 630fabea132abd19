"""IncrementalDecoder on a fake byte-level tokenizer: one token per UTF-8 byte, decoded as HF's
byte-level decoder does (``bytes.decode("utf-8", "replace")``), so every multi-byte character
is split over tokens."""

from __future__ import annotations

from fastprefill.text import REPLACEMENT, IncrementalDecoder


class ByteTokenizer:
    """One token per byte; counts the tokens it decodes."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", "replace")


def _stream(data: bytes) -> tuple[list[str], str]:
    """Push each byte of ``data`` as a token; the deltas (and the flush) and the final decode."""
    inc = IncrementalDecoder(ByteTokenizer())
    deltas = [inc.push(b) for b in data]
    return [*deltas, inc.flush()], data.decode("utf-8", "replace")


def test_characters_split_over_tokens_come_whole_and_add_up_to_the_decode():
    text = "Напиши 🎉 龘 𠀀 ok"
    deltas, final = _stream(text.encode())
    assert final == text
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert "🎉" in deltas and "𠀀" in deltas  # each sent once, whole, with its last byte
    # the naive delta (decode[len(previous decode):]) is what this replaces: it loses characters
    data, naive, prev = text.encode(), [], ""
    for k in range(1, len(data) + 1):
        cur = data[:k].decode("utf-8", "replace")
        naive.append(cur[len(prev):])
        prev = cur
    assert "".join(naive) != text


def test_a_sequence_ending_inside_a_character_flushes_the_decoders_replacement():
    data = "ok 🎉".encode()[:-2]  # cut inside the emoji, as max_tokens may
    deltas, final = _stream(data)
    assert final == "ok " + REPLACEMENT
    assert deltas[-1] == REPLACEMENT and "".join(deltas) == final


def test_an_invalid_byte_in_the_middle_passes_through_as_the_final_decode_has_it():
    data = b"a\x80b\xe4\xb8\xadc"  # a stray continuation byte, then a valid 3-byte character
    deltas, final = _stream(data)
    assert final == "a" + REPLACEMENT + "b中c"
    assert "".join(deltas) == final
    assert IncrementalDecoder(ByteTokenizer()).flush() == ""


def test_each_push_decodes_a_short_window_not_the_whole_sequence():
    tok = ByteTokenizer()
    inc = IncrementalDecoder(tok)
    text = "plain ascii text " * 200
    assert "".join(inc.push(b) for b in text.encode()) == text
    assert tok.decoded <= 4 * len(text)  # linear in the length (a full decode per token: quadratic)
