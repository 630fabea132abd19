"""Limits a request meets before any model work: the body's size and the prompt's length in characters.

- :func:`read_body` reads a body of at most ``max_bytes``: a ``Content-Length`` over the limit
  is refused before a byte is read, and a body sent without one (chunked) is counted as it
  arrives and refused as soon as it passes the limit. The rest of a refused body is never
  kept (uvicorn reads and drops it after the answer).
- :func:`prompt_char_limit` gives a number of characters that no prompt fitting the model's
  context can exceed, so an over-long prompt is refused in the time it takes to count its
  characters instead of the time it takes to tokenize it.

Why the character bound is safe: every character of the prompt ends up inside some token (the
tokenizer drops nothing), and one token covers at most ``L`` characters of the normalized text,
``L`` being the longest entry of the vocabulary (a byte-level entry spells each byte as one
character, and a character is at least one byte; a SentencePiece entry spells each character as
itself, a byte-fallback entry ``<0xAB>`` with six characters for one byte). A normalizer may
merge characters: NFC composes one character from at most :data:`NFC_MERGE` (its canonical
decomposition), NFKC from at most :data:`NFKC_MERGE`. So a prompt of ``T`` tokens has at most
``T * L * merge`` characters, and one with more than ``context * L * merge`` cannot fit. For a
tokenizer that can drop or fuse text (a whitespace-splitting pre-tokenizer, an accent-stripping
or regex normalizer, an unknown-token model without byte fallback, special tokens that swallow
neighbouring spaces) no such bound holds, and :func:`prompt_char_limit` returns ``None``.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from transformers import PreTrainedTokenizerBase

from fastprefill.serve.protocol import APIError

__all__ = ["NFC_MERGE", "NFKC_MERGE", "longest_token_chars", "prompt_char_limit", "read_body"]

#: The longest canonical decomposition of one character (what NFC can merge into one).
NFC_MERGE = 4
#: The longest compatibility decomposition of one character (what NFKC can merge into one).
NFKC_MERGE = 18

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                         "(--max-body-mb); send a shorter prompt")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, at most ``max_bytes`` of it.

    Raises:
        APIError: 413 when ``Content-Length`` says more (nothing is read), or as soon as a body
            without one passes ``max_bytes``.
    """
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _merge(normalizer: dict[str, Any] | None) -> int | None:
    """How many input characters one output character of ``normalizer`` may stand for (None: unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers", []):
            factor = _merge(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):  # never shorter than the input
        return 1
    if kind == "NFC":
        return NFC_MERGE
    if kind == "NFKC":
        return NFKC_MERGE
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}).get("String"), normalizer.get("content", "")
        if pattern and content:  # a literal of len(pattern) becomes len(content) characters
            return max(1, -(-len(pattern) // len(content)))
    return None  # Strip, StripAccents, Bert, Precompiled, regex Replace: may drop text


def _keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _byte_level(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """Prompt characters one token can stand for at most, normalization included; ``None`` when
    the tokenizer may drop or fuse text (see the module docstring), or is not a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    merge = _merge(spec.get("normalizer"))
    every_byte = _byte_level(pre) or bool(model.get("byte_fallback"))
    if merge is None or not _keeps_text(pre) or model.get("type") not in ("BPE", "Unigram") or not every_byte:
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])):
        return None  # such a special token swallows the spaces beside it
    return merge * max(len(token) for token in tokenizer.get_vocab())


def prompt_char_limit(tokenizer: PreTrainedTokenizerBase, context_tokens: int) -> int | None:
    """Characters above which a prompt cannot fit in ``context_tokens`` tokens (``None``: no safe bound)."""
    longest = longest_token_chars(tokenizer)
    return None if longest is None else context_tokens * longest
