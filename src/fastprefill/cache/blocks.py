"""The block index that the prefix cache and the chunk store keep their K/V in: blocks keyed by
digest, linked to their parents, held under a byte bound and evicted least recently used leaf first.

**Keys.** A token sequence is cut into blocks of ``block_tokens`` tokens; block ``i``'s key is a
BLAKE2b digest of its tokens and of block ``i - 1``'s key (:func:`block_keys`), so one key names
the whole prefix up to it. Each block keeps its own token ids too, for its owner to compare on
every hit (a digest collision must never hand one prompt another prompt's K/V).

**Eviction.** A block is evicted only when no held block continues it (a leaf), so no held block
is ever unreachable. :meth:`BlockIndex.refresh` makes a chain the most recent child-first, so its
root stays the most recent and leaves go first.

Not locked: its owner (:class:`~fastprefill.prefix_cache.PrefixCache`) holds one lock around
every call. Shapes: a block's K/V is ``(2, L, H_kv, B, d)`` (keys, values).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Block", "BlockIndex", "block_keys"]


def block_keys(ids: Sequence[int], block_tokens: int) -> list[tuple[bytes, tuple[int, ...]]]:
    """``(key, tokens)`` of every whole block of ``ids``, in order (a last partial block has none)."""
    ids = [int(t) for t in ids]
    # the tokens as native int64 bytes, as a torch int64 tensor holds them (the keys saved caches keep)
    raw, width = memoryview(array("q", ids).tobytes()), array("q").itemsize * block_tokens
    out = []
    parent = b""
    for i, start in enumerate(range(0, len(ids) - block_tokens + 1, block_tokens)):
        digest = hashlib.blake2b(parent + raw[i * width:(i + 1) * width], digest_size=16).digest()
        out.append((digest, tuple(ids[start:start + block_tokens])))
        parent = digest
    return out


@dataclass
class Block:
    """One held block: its tokens, its parent's key and its K/V ``(2, L, H_kv, B, d)``; ``start``
    is ``None`` for a prefix block, the first position of an entry of the owner's own kind (a
    :class:`~fastprefill.chunk_store.ChunkStore` chunk: ``B`` is then its length)."""

    tokens: tuple[int, ...]
    parent: bytes | None
    kv: torch.Tensor
    children: int = 0
    start: int | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class BlockIndex:
    """Blocks by key in least recently used order, with the bytes they hold (see the module docstring).

    Args:
        max_bytes: the bound :meth:`evict` brings the held bytes under.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # LRU order: oldest first

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def items(self) -> Iterator[tuple[bytes, Block]]:
        """Every ``(key, block)``, least recently used first."""
        return iter(self._blocks.items())

    def touch(self, key: bytes) -> None:
        """Make the held block ``key`` the most recently used."""
        self._blocks.move_to_end(key)

    def refresh(self, keys: Sequence[bytes]) -> None:
        """Make a chain of keys (root first) the most recently used, child first: the root ends
        the most recent, so leaves go first; keys not held are skipped."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def insert(self, key: bytes, block: Block) -> None:
        """Hold ``block`` (its parent, if any, must be held) as the most recently used."""
        self._blocks[key] = block
        self.nbytes += block.nbytes
        if block.parent is not None:
            self._blocks[block.parent].children += 1

    def evict(self, protect: Collection[bytes] = frozenset()) -> int:
        """Drop least recently used leaves until the bytes fit ``max_bytes``; the blocks in
        ``protect`` (just stored) go last. Returns the blocks dropped."""
        dropped = 0
        while self.nbytes > self.max_bytes:
            victim = next((k for k, blk in self._blocks.items() if blk.children == 0 and k not in protect), None)
            if victim is None:
                victim = next((k for k, blk in self._blocks.items() if blk.children == 0), None)
            if victim is None:  # cannot happen: a non-empty forest has a leaf
                break
            block = self._blocks.pop(victim)
            self.nbytes -= block.nbytes
            if block.parent is not None and block.parent in self._blocks:
                self._blocks[block.parent].children -= 1
            dropped += 1
        return dropped

    def depth(self, key: bytes) -> int:
        """How many ancestors the held block ``key`` has (0 for a root)."""
        depth, parent = 0, self._blocks[key].parent
        while parent is not None:
            depth, parent = depth + 1, self._blocks[parent].parent
        return depth

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
        self.nbytes = 0
