"""Rank 0's book of KV-cache blocks: which block holds which tokens, who uses it, what stays cached.

The cache is a pool of fixed-size blocks; a sequence owns a block table (its blocks in position
order). A full block is known by a hash of its tokens chained to the hash of the blocks before it
(and the request's salt: its cache salt and LoRA adapter), so equal hashes mean equal prefixes; a hit is still checked
against the block's tokens, since hashes can collide. Blocks nobody uses stay cached in
least-recently-freed order and are taken back only when the pool needs them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


def chain_hash(previous: int | None, tokens: tuple[int, ...], salt: object) -> int:
    """The key of a full block: its tokens after the prefix `previous` stands for."""
    return hash((previous, salt, tokens))


@dataclass
class Block:
    id: int
    refs: int = 0
    key: int | None = None  # chain_hash of its tokens, once full and cached
    tokens: tuple[int, ...] = ()


class BlockPool:
    """Allocation, reference counts and the prefix cache over `n_blocks` blocks of `size` positions."""

    def __init__(self, n_blocks: int, size: int, caching: bool = True):
        if n_blocks < 1 or size < 1:
            raise ValueError("n_blocks and size must be >= 1")
        self.size, self.caching = size, caching
        self.blocks = [Block(i) for i in range(n_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))  # refs == 0, oldest first
        self.cached: dict[int, int] = {}  # key -> block id

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def used(self) -> int:
        return self.n_blocks - len(self.free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.size)

    def match(self, tokens: list[int], salt: object) -> list[int]:
        """The cached blocks that hold a prefix of `tokens`, in order (not yet taken)."""
        if not self.caching:
            return []
        found, key = [], None
        for start in range(0, len(tokens) - self.size + 1, self.size):
            chunk = tuple(tokens[start : start + self.size])
            key = chain_hash(key, chunk, salt)
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].tokens != chunk:  # the token check: no trust in hashes
                break
            found.append(block_id)
        return found

    def take(self, block_ids: list[int]) -> None:
        """One more user of each block (cached blocks found by `match`)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.refs == 0:
                del self.free[block_id]
            block.refs += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting the least recently freed cached ones; the caller checked `len(free)`."""
        if n > len(self.free):
            raise RuntimeError(f"{n} blocks asked of {len(self.free)} free")
        taken = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None and self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key, block.tokens, block.refs = None, (), 1
            taken.append(block_id)
        return taken

    def release(self, block_ids: list[int]) -> None:
        """One user fewer; a block nobody uses goes to the back of the free queue, still cached."""
        for block_id in reversed(block_ids):  # a table's tail is evicted before its head
            block = self.blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                self.free[block_id] = None

    def remember(self, block_id: int, previous: int | None, tokens: tuple[int, ...], salt: object) -> int:
        """Cache a block just filled with `tokens` after the prefix keyed `previous`; returns its key."""
        key = chain_hash(previous, tokens, salt)
        block = self.blocks[block_id]
        block.key, block.tokens = key, tokens
        if self.caching and key not in self.cached:
            self.cached[key] = block_id
        return key
