"""Predictor checkpoints: safetensors weights + a JSON config, written atomically.

Layout of a checkpoint directory::

    config.json                   the commit point: names the files below, their sha256, the base
                                  and aux models (zoo names, shapes, weight fingerprints,
                                  tokenizer fingerprint), the layer map, λ and the training step
    predictor-<step>.safetensors  the maps (k_maps.<l>.weight/bias, v_maps.<l>.weight/bias)
    train-<step>.pt               optional: optimizer / RNG / loss history, for ``--resume``
    loss.png, loss.json           optional: the loss curve

Every file is written to a temporary name and moved into place with ``os.replace``; data files
first, ``config.json`` last, and superseded data files are deleted only after that. A kill at
any moment leaves ``config.json`` pointing at complete files, so resuming always works.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fastprefill.errors import ConfigError
from fastprefill.models.fingerprint import file_sha256

__all__ = ["FORMAT", "CheckpointError", "atomic_torch_save", "atomic_write_bytes", "read_checkpoint", "write_checkpoint"]

FORMAT = "fastprefill-kv-prediction"
VERSION = 1


class CheckpointError(ConfigError):
    """A predictor checkpoint is missing, corrupted, or made for other models (a configuration
    error: the predictor named is not one this model can use)."""


def _atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then ``os.replace(tmp_path, path)``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (tmp file + ``os.replace``)."""
    _atomic(Path(path), lambda tmp: Path(tmp).write_bytes(data))


def atomic_torch_save(path: str | os.PathLike[str], obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` atomically (tmp file + ``os.replace``)."""
    _atomic(Path(path), lambda tmp: torch.save(obj, tmp))


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    state_dict: dict[str, torch.Tensor],
    meta: dict[str, Any],
    step: int,
    train_state: dict[str, Any] | None = None,
    dtype: torch.dtype | None = torch.float32,
) -> Path:
    """Write a checkpoint atomically (see the module docstring). Returns the directory.

    ``dtype``: the weights' storage dtype (``None`` keeps each tensor's own).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = _read_config(out) if (out / "config.json").exists() else None
    weights = out / f"predictor-{step:06d}.safetensors"
    tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in state_dict.items()}
    _atomic(weights, lambda tmp: save_file(tensors, tmp))
    train_name = None
    if train_state is not None:
        train_name = f"train-{step:06d}.pt"
        _atomic(out / train_name, lambda tmp: torch.save(train_state, tmp))
    config = dict(meta)
    config.update(
        format=FORMAT,
        version=VERSION,
        step=int(step),
        weights=weights.name,
        weights_sha256=file_sha256(weights),
        train_state=train_name,
    )
    atomic_write_bytes(out / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
    if old is not None:  # remove the superseded files only once the new config is in place
        for key in ("weights", "train_state"):
            name = old.get(key)
            if name and name not in (config["weights"], config["train_state"]):
                (out / name).unlink(missing_ok=True)
    return out


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"corrupted KV Prediction checkpoint {path}: config.json is unreadable ({exc})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(f"{path}/config.json is not a KV Prediction checkpoint (format != {FORMAT!r})")
    return config


def read_checkpoint(
    path: str | os.PathLike[str], with_train_state: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any] | None]:
    """Read and verify a checkpoint.

    Returns:
        ``(config, state_dict, train_state or None)``.

    Raises:
        CheckpointError: missing directory / config, unreadable JSON, weights file missing, its
            sha256 differing from the config's, or unreadable safetensors.
    """
    root = Path(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(
            f"no KV Prediction checkpoint at {root} (config.json missing); train one with "
            "`fastprefill train-kvp` or pass the directory it wrote"
        )
    config = _read_config(root)
    weights = root / str(config.get("weights"))
    if not weights.is_file():
        raise CheckpointError(f"corrupted checkpoint {root}: weights file {weights.name} is missing")
    if file_sha256(weights) != config.get("weights_sha256"):
        raise CheckpointError(f"corrupted checkpoint {root}: {weights.name} does not match its sha256 in config.json")
    try:
        state = load_file(str(weights))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"corrupted checkpoint {root}: cannot read {weights.name} ({exc})") from None
    train_state = None
    if with_train_state and config.get("train_state"):
        try:
            train_state = torch.load(root / config["train_state"], weights_only=False)
        except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
            raise CheckpointError(f"corrupted checkpoint {root}: cannot read {config['train_state']} ({exc})") from None
    return config, state, train_state
