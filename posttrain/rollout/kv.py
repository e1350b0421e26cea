"""Paged KV bookkeeping: fixed-size blocks, reference counts, a hash-chained prefix cache.

No tensors live here: the runner owns the KV storage (num_blocks × block_size slots, allocated
once) and this class decides which block each sequence's tokens go to.

- A full block is identified by hash(previous block's hash, its tokens). When a sequence frees a
  block, the block keeps its hash and contents until it is reused, so a later prompt that starts
  with the same tokens (the next turn of a conversation, the same prompt in the next RL step) gets
  those blocks back without recomputing them.
- `fork` shares a prompt's blocks among the G samples of a group (ref count + 1 on full blocks;
  the partly filled last block is copied, since each sample writes its own tokens into it).
- Free blocks are reused oldest-freed first, so recently used prefixes stay cached longest.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


def block_hash(prev: int | None, tokens) -> int:
    return hash((prev, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: deque[int] = deque(range(num_blocks))
        self.free_set = set(range(num_blocks))
        self.stale: set[int] = set()  # in use across a reset_prefix_cache: never entered into the cache

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Cached full blocks that form a prefix of `token_ids` (at least one token left to compute)."""
        hits, prev, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(prev, chunk)
            b = self.cached.get(h)
            if b is None or self.tokens[b] != chunk:
                break
            hits.append(b)
            prev = h
        return hits

    def can_allocate(self, token_ids: list[int], extra_blocks: int = 0) -> bool:
        hits = self.lookup(token_ids)
        revived = sum(1 for b in hits if self.ref[b] == 0)
        return self.blocks_for(len(token_ids)) - len(hits) + revived + extra_blocks <= self.num_free

    # ------------------------------------------------------------ allocation
    def _take(self) -> int:
        if not self.free:
            raise NoFreeBlocks("KV cache is full")
        b = self.free.popleft()
        self.free_set.discard(b)
        if self.hash[b] is not None and self.cached.get(self.hash[b]) == b:
            del self.cached[self.hash[b]]
        self.hash[b], self.tokens[b] = None, None
        self.ref[b] = 1
        self.stale.discard(b)
        return b

    def allocate(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Blocks for a new sequence holding `token_ids`; returns (block table, tokens already cached)."""
        if not self.can_allocate(token_ids):
            raise NoFreeBlocks(f"need {self.blocks_for(len(token_ids))} blocks, {self.num_free} free")
        hits = self.lookup(token_ids)
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
                self.free_set.discard(b)
            self.ref[b] += 1
        table = hits + [self._take() for _ in range(self.blocks_for(len(token_ids)) - len(hits))]
        return table, len(hits) * self.block_size

    def append_block(self) -> int:
        return self._take()

    def fork(self, table: list[int], num_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """A copy-on-write child of a sequence with `num_tokens` tokens in `table`.

        Returns (child table, (src, dst) block copy the runner must do, or None)."""
        partial = num_tokens % self.block_size != 0
        shared = table[:-1] if partial else list(table)
        if partial and not self.free:
            raise NoFreeBlocks("no block for a forked sample")
        for b in shared:
            self.ref[b] += 1
        if not partial:
            return shared, None
        dst = self._take()
        return shared + [dst], (table[-1], dst)

    def register(self, table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Enter every full block whose KV is computed (first `num_computed` tokens) into the prefix cache.
        Stops at a stale block (its KV, and so every later block's, predates a weight update)."""
        prev, bs = None, self.block_size
        for i in range(min(num_computed // bs, len(table))):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(prev, chunk)
            b = table[i]
            if b in self.stale:
                return
            if self.hash[b] is None:
                if h in self.cached and self.cached[h] != b:  # same content elsewhere: keep the first
                    prev = h
                    continue
                self.hash[b], self.tokens[b] = h, chunk
                self.cached[h] = b
            prev = h

    def free_table(self, table: list[int]) -> None:
        """Release a sequence's blocks; blocks reaching ref 0 go to the back of the free queue."""
        for b in reversed(table):  # tail first: the prompt's head blocks are freed last, evicted last
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} freed twice"
            if self.ref[b] == 0:
                self.free.append(b)
                self.free_set.add(b)

    def reset_prefix_cache(self) -> None:
        """Forget cached contents (after a weight update the cached KV is stale). Blocks in use stay with
        their sequences but are marked stale, so finishing them does not enter old KV into the cache."""
        self.cached.clear()
        for b in range(self.num_blocks):
            self.hash[b], self.tokens[b] = None, None
            if self.ref[b] > 0:
                self.stale.add(b)
