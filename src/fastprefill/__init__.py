"""fastprefill: faster time to first token for Hugging Face causal language models.

Public API (explicit re-exports; importing this package has no side effects)::

    from fastprefill import generate, load_model, LazyLLM
    model, tok = load_model("smollm2-135m")
    result = generate(model, tok, "Summarise: ...", method=LazyLLM(preset="default"))
    print(result.text, result.timing.ttft_s)

Method classes, the method registry (``make_method``, ``METHODS``) and ``RankPool`` (the ranks
``KVRunahead`` runs on) are imported on first access, so an optional piece that is missing never
breaks the rest. Every name the README's snippets import comes from here.
"""

from __future__ import annotations

import importlib
from typing import Any

from fastprefill.engine import GenerationResult, StreamEvent, Timing, generate, stream
from fastprefill.errors import (
    ChecksumError,
    ConfigError,
    FastprefillError,
    MissingPackageError,
    ModelNotFoundError,
    PromptError,
    UnsupportedModelError,
)
from fastprefill.methods.base import ComputeStats, Method, PrefillOutput
from fastprefill.methods.full import FullPrefill
from fastprefill.prefix_cache import PrefixCache
from fastprefill.sampling import SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "Blend": "fastprefill.methods.research.blend",
    "ChunkStore": "fastprefill.chunk_store",
    "ChunkedPrompt": "fastprefill.prompt",
    "Passage": "fastprefill.prompt",
    "LazyLLM": "fastprefill.methods.lazyllm",
    "RandomDrop": "fastprefill.methods.baselines",
    "StaticPruning": "fastprefill.methods.baselines",
    "GemFilter": "fastprefill.methods.baselines",
    "KVPrediction": "fastprefill.methods.kv_prediction",
    "KVPrefix": "fastprefill.methods.kv_prediction",
    "KVRunahead": "fastprefill.methods.runahead",
    "METHODS": "fastprefill.methods.registry",
    "RankPool": "fastprefill.distributed.pool",
    "load_model": "fastprefill.models",
    "make_method": "fastprefill.methods.registry",
}

__all__ = [  # noqa: PLE0604 - *_LAZY adds its keys, all strings
    "ChecksumError",
    "ComputeStats",
    "ConfigError",
    "FastprefillError",
    "FullPrefill",
    "GenerationResult",
    "Method",
    "MissingPackageError",
    "ModelNotFoundError",
    "PrefillOutput",
    "PrefixCache",
    "PromptError",
    "SamplingParams",
    "StreamEvent",
    "Timing",
    "UnsupportedModelError",
    "generate",
    "stream",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        attr = "load" if name == "load_model" else name
        return getattr(module, attr)
    raise AttributeError(f"module 'fastprefill' has no attribute {name!r}")
