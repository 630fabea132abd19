"""Cheap fingerprints that identify a model's weights and a tokenizer.

Stored wherever a file is only valid for one model: KV Prediction checkpoints, the prefix
cache's saved blocks, tuning profiles. A mismatch is refused with a message, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastprefill.models.shape import ModelShape

__all__ = ["PROBE_TEXT", "file_sha256", "tokenizer_fingerprint", "weights_fingerprint"]

#: Probe text for tokenizer comparison: prose, code, digits, whitespace and non-ASCII.
PROBE_TEXT = "def f(x):\n    return x ** 2  # The café's 3.14 π — 東京 naïve\tend"


def weights_fingerprint(model: PreTrainedModel) -> str:
    """A cheap sha256 identifying a model's weights.

    Hashes the shape (:class:`ModelShape`) and, for every parameter in name order, its name,
    shape and a fixed sample of its values (the first 256 and 256 evenly strided elements,
    rounded to bfloat16). That is milliseconds even for 1.5B parameters, yet any other checkpoint
    of the same architecture differs in the sampled values. The rounding makes the fingerprint
    name the checkpoint, not the dtype it was loaded in: a model loaded in float32 and the same
    one loaded in bfloat16 have one fingerprint (files that also depend on the dtype, the prefix
    cache's and tuning profiles, record it beside). Parameters shared under several names (tied
    embeddings) are hashed once.
    """
    digest = hashlib.sha256(repr(ModelShape.from_config(model.config)).encode())
    seen: set[int] = set()
    for name, param in sorted(model.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
        if id(param) in seen:
            continue
        seen.add(id(param))
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 256)
        sample = torch.cat([flat[:256], flat[::step][:256]]).to(torch.bfloat16).float().cpu()
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's full vocabulary (token -> id) and of a probe encoding."""
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    digest.update(json.dumps(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)).encode())
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
