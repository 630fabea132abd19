"""Any transformers causal LM as ``(model, tokenizer)``: a zoo name (prepared first), a local model
folder or a Hugging Face id, checked to be a decoder-only causal LM before its weights load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastprefill.errors import ModelNotFoundError, UnsupportedModelError
from fastprefill.host import resolve_dtype
from fastprefill.models.zoo import ZOO, ZooEntry, prepare, resolve_entry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_pretrained"]


def _resolve_source(
    name_or_path: str | os.PathLike[str] | ZooEntry, cache_dir: str | os.PathLike[str] | None, progress: bool
) -> str:
    """A folder or Hugging Face id that ``from_pretrained`` takes, preparing zoo entries first."""
    if isinstance(name_or_path, ZooEntry) or (isinstance(name_or_path, str) and name_or_path in ZOO):
        return str(prepare(name_or_path, cache_dir=cache_dir, progress=progress))
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if not isinstance(name_or_path, str) or text.startswith(("/", ".", "~")) or path.exists():
        raise ModelNotFoundError(f"No model folder at {text!r}. Known zoo models: {', '.join(ZOO)}.")
    if "/" not in text:
        resolve_entry(text)  # raises ModelNotFoundError listing the known names
    return text  # a Hugging Face id, for users who have the hub


def _check_causal_lm(config, source: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{source} is a {model_type!r} model, not a decoder-only causal LM that "
            "AutoModelForCausalLM can load; fastprefill only speeds up causal LMs."
        )


def load_pretrained(
    name_or_path: str | os.PathLike[str] | ZooEntry,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM in eval mode on ``device``, and its tokenizer.

    ``name_or_path`` is a zoo name (prepared into the cache first, :func:`~fastprefill.models.zoo.prepare`),
    a local model folder, or a Hugging Face id ``owner/name`` (needs the hub). ``dtype``: see
    :func:`fastprefill.host.resolve_dtype` (``"auto"``: bfloat16 where the device multiplies it
    natively, float32 elsewhere).

    Raises:
        ConfigError: an unknown ``dtype``.
        ModelNotFoundError: a bare name that is not in the zoo, a path that is no folder, or a
            Hugging Face id that cannot be fetched (offline, or no such model).
        UnsupportedModelError: the model is not a decoder-only causal LM.
        MissingPackageError, ChecksumError: see :func:`~fastprefill.models.zoo.prepare`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(dtype, device)
    source = _resolve_source(name_or_path, cache_dir, progress)
    try:
        config = AutoConfig.from_pretrained(source)
        _check_causal_lm(config, source)
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:  # hub unreachable, no such id, or files missing: one line, not the hub's traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"cannot load model {source!r} ({reason}). Give a zoo name ({', '.join(ZOO)}; see `fastprefill "
            "models`), a local model folder, or a Hugging Face id that exists; without network, set HF_HUB_OFFLINE=1 "
            "to use only models already in the Hugging Face cache.") from exc
    except UnsupportedModelError:
        raise
    except ValueError as exc:
        raise UnsupportedModelError(f"AutoModelForCausalLM cannot load {source}: {exc}") from exc
    model.to(device)
    model.eval()
    return model, tokenizer
