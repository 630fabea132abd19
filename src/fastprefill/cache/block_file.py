"""The file a :class:`~fastprefill.cache.blocks.BlockIndex` is saved to and loaded from (the prefix
cache's and the chunk store's persistence).

One safetensors file ``<stem>.safetensors``, one tensor per block (its K/V, named by its key in
hex), with a JSON header under the metadata key ``fastprefill``: what the blocks are valid for
(format tag, :data:`VERSION`, model weights fingerprint, dtype, block size) and each block's key,
parent, tokens, recency rank and, for a chunk, first position, parents before children. Beside
it ``<stem>.sha256``, the file's checksum. The file is written under another name and moved into
place, so a crash never leaves half a file; a file whose checksum or header does not match is
refused with a message (:class:`PrefixCacheError`) and nothing is loaded from it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastprefill.cache.blocks import Block, BlockIndex
from fastprefill.errors import FastprefillError
from fastprefill.models.fingerprint import file_sha256

__all__ = ["VERSION", "PrefixCacheError", "SavedBlocks", "check_identity", "open_blocks", "restore_blocks",
           "snapshot", "write_blocks"]

#: The header's version: a file of another version is refused.
VERSION = 1


class PrefixCacheError(FastprefillError, ValueError):
    """A saved prefix cache that is corrupt or belongs to another model, dtype or block size."""


def snapshot(index: BlockIndex, identity: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and tensors of a file holding every block of ``index`` (K/V copied to the CPU).

    Args:
        identity: ``format``, ``fingerprint``, ``dtype`` and ``block_tokens`` of the blocks' owner.
    """
    held = list(index.items())
    lru = {key: rank for rank, (key, _) in enumerate(held)}  # 0 = least recently used
    blocks = sorted(held, key=lambda item: (index.depth(item[0]), lru[item[0]]))  # parents first
    tensors = {key.hex(): block.kv.detach().to("cpu").contiguous() for key, block in blocks}
    header = {
        "format": identity["format"], "version": VERSION, "fingerprint": identity["fingerprint"],
        "dtype": identity["dtype"], "block_tokens": identity["block_tokens"],
        "blocks": [{"key": key.hex(), "parent": None if block.parent is None else block.parent.hex(),
                    "tokens": list(block.tokens), "lru": lru[key],
                    **({} if block.start is None else {"start": block.start})} for key, block in blocks],
    }
    return header, tensors


def write_blocks(folder: str | os.PathLike[str], stem: str, header: dict[str, Any],
                 tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``folder/<stem>.safetensors`` (atomically) and its sha256 sidecar; returns the file."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.safetensors"
    tmp = folder / f".{stem}.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"fastprefill": json.dumps(header)})
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    (folder / f"{stem}.sha256").write_text(digest + "\n")
    return path


@dataclass
class SavedBlocks:
    """An open saved file: its path, its header and the handle its tensors are read through."""

    path: Path
    header: dict[str, Any]
    handle: Any


@contextlib.contextmanager
def open_blocks(folder: str | os.PathLike[str], stem: str) -> Iterator[SavedBlocks | None]:
    """Open ``folder/<stem>.safetensors`` for the duration of the block (``None``: no file).

    Raises:
        PrefixCacheError: the checksum does not match the sidecar, or the file (or anything done
            with it inside the block) fails to read: a message, never a deep traceback. Errors of
            fastprefill's own raised inside the block pass unchanged.
    """
    from safetensors import safe_open

    folder = Path(folder)
    path, sidecar = folder / f"{stem}.safetensors", folder / f"{stem}.sha256"
    if not path.exists():
        yield None
        return
    if not sidecar.exists() or sidecar.read_text().strip() != file_sha256(path):
        raise PrefixCacheError(f"{path}: its sha256 does not match {sidecar.name}; the file is corrupt "
                               "(delete it; the cache refills as requests come)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield SavedBlocks(path, json.loads((handle.metadata() or {}).get("fastprefill", "{}")), handle)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        if isinstance(exc, FastprefillError):
            raise
        raise PrefixCacheError(f"{path} is not a readable prefix cache ({exc}); delete it") from None


def check_identity(saved: SavedBlocks, identity: dict[str, Any]) -> None:
    """Refuse a file saved for other blocks than ``identity``'s (as :func:`snapshot` takes it).

    Raises:
        PrefixCacheError: another format or version, model (weights fingerprint), dtype or block size.
    """
    header, path = saved.header, saved.path
    if header.get("format") != identity["format"] or header.get("version") != VERSION:
        raise PrefixCacheError(f"{path} is not a fastprefill prefix cache (format {header.get('format')!r})")
    if header.get("fingerprint") != identity["fingerprint"]:
        raise PrefixCacheError(f"{path} was saved for another model (weights fingerprint differs); "
                               "it is ignored: delete it or point --prefix-cache-dir elsewhere")
    if header.get("dtype") != identity["dtype"]:
        raise PrefixCacheError(f"{path} holds {header.get('dtype')} K/V; the model runs in {identity['dtype']}")
    if header.get("block_tokens") != identity["block_tokens"]:
        raise PrefixCacheError(f"{path} has blocks of {header.get('block_tokens')} tokens, this cache "
                               f"{identity['block_tokens']}")


def restore_blocks(index: BlockIndex, saved: SavedBlocks, device: torch.device) -> int:
    """Insert the saved blocks that ``index`` does not hold (a block whose parent it does not hold
    is skipped), on ``device``, in the saved recency order after what it holds; returns how many."""
    new: dict[bytes, int] = {}
    for entry in saved.header["blocks"]:  # parents before children
        key = bytes.fromhex(entry["key"])
        parent = None if entry["parent"] is None else bytes.fromhex(entry["parent"])
        if key in index or (parent is not None and parent not in index):
            continue
        kv = saved.handle.get_tensor(entry["key"]).to(device)
        index.insert(key, Block(tuple(entry["tokens"]), parent, kv, start=entry.get("start")))
        new[key] = int(entry["lru"])
    for key in sorted(new, key=new.__getitem__):  # restore the saved recency order
        index.touch(key)
    return len(new)
