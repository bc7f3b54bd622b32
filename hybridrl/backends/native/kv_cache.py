"""KV-cache blocks: allocation, reference counts and the prefix cache.

`BlockPool` is bookkeeping only (the tensor lives in the engine). A block is *free* (holds
nothing reusable), *referenced* by one or more running sequences, or *evictable*: unreferenced
but still holding KV that a later request may reuse; evictable blocks are recycled in LRU
order when the free list is empty.

Prefix reuse:
- a full block is identified by its chain hash, blake2b(parent chain hash + its token ids),
  rooted at a salt that changes with every weight change, so KV computed with other weights
  can never match; a new request walks its prompt's chain and shares every block it finds
  (reference counted, read-only: a full block is never written again);
- the first block that does not match may still share a prefix with a block under the same
  parent (the partial last block of a sibling sample, or of the previous turn of an agent
  episode): those rows are copied into the new request's own block (copy on write), so n
  samples of one prompt compute its prefill once plus one token each.
A block enters the cache only after its KV has been computed (`record`), never when allocated.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n:
        j = min(i + 64, n)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n


@dataclass
class PrefixHit:
    blocks: list[int] = field(default_factory=list)     # shared full blocks, in order
    chain: list[bytes] = field(default_factory=list)    # their chain hashes
    copy_from: int | None = None                        # block whose first `copy_rows` rows are reusable
    copy_rows: int = 0

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size + self.copy_rows


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()   # LRU first
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.parent_of: list[bytes | None] = [None] * num_blocks
        self.tokens_of: list[list[int]] = [[] for _ in range(num_blocks)]
        self.by_hash: dict[bytes, int] = {}
        self.children: dict[bytes, set[int]] = {}
        self.epoch = 0
        self.salt = self._salt()

    # -- accounting ---------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now (free + evictable)."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise RuntimeError(f"KV cache: {n} blocks requested, {self.num_available} available")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def pin(self, block: int) -> None:
        """Take one more reference (a cache hit, or the source of a copy)."""
        if self.ref[block] == 0:
            self.evictable.pop(block, None)
        self.ref[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference each; pass a sequence's blocks tail first so its prefix stays cached longest."""
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] > 0:
                continue
            if self.caching and (self.hash_of[b] is not None or self.tokens_of[b]):
                self.evictable[b] = None
            else:
                self._forget(b)
                self.free.append(b)

    def _forget(self, b: int) -> None:
        h = self.hash_of[b]
        if h is not None and self.by_hash.get(h) == b:
            del self.by_hash[h]
        parent = self.parent_of[b]
        if parent is not None:
            siblings = self.children.get(parent)
            if siblings is not None:
                siblings.discard(b)
                if not siblings:
                    del self.children[parent]
        self.hash_of[b] = None
        self.parent_of[b] = None
        self.tokens_of[b] = []

    # -- prefix cache -------------------------------------------------------------------------

    def _salt(self) -> bytes:
        return hashlib.blake2b(f"hybridrl-native-kv/{self.epoch}".encode(), digest_size=16).digest()

    def invalidate(self) -> None:
        """Forget every cached block (the weights changed). Referenced blocks stay allocated."""
        self.epoch += 1
        self.salt = self._salt()
        for b in list(self.evictable):
            self._forget(b)
            self.free.append(b)
        self.evictable.clear()
        for b in range(self.num_blocks):
            if self.ref[b]:
                self._forget(b)
        self.by_hash.clear()
        self.children.clear()
        # Canonical order: which physical block a request gets must not depend on what the engine
        # served before this version. It decides nothing in attention (blocks are gathered in logical
        # order) but it orders `children` (a set), which breaks ties between equally long partial
        # prefixes whose rows were computed in different batches (equal to rounding, not bitwise).
        # Without this a resumed run, whose engine has a shorter history, samples the same tokens
        # with logprobs that differ in the last bits.
        self.free = deque(sorted(self.free))

    def chain(self, tokens: Sequence[int], num_blocks: int, cache: list | None = None) -> list[bytes]:
        """Chain hashes of the first num_blocks full blocks of tokens. `cache` ([salt, hashes], kept by
        the caller across steps) saves rehashing a waiting request's prompt every step."""
        if cache is None:
            cache = [self.salt, []]
        if cache[0] != self.salt:
            cache[0], cache[1] = self.salt, []
        hashes = cache[1]
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else self.salt, tokens[j * bs:(j + 1) * bs]))
        return hashes[:num_blocks]

    def lookup(self, tokens: Sequence[int], limit: int, cache: list | None = None) -> PrefixHit:
        """The cached KV usable for tokens[:limit]: shared full blocks, then rows to copy."""
        hit = PrefixHit()
        if not self.caching or limit <= 0:
            return hit
        bs = self.block_size
        parent = self.salt
        for h in self.chain(tokens, limit // bs, cache):
            b = self.by_hash.get(h)
            if b is None:
                break
            hit.blocks.append(b)
            hit.chain.append(h)
            parent = h
        start = len(hit.blocks) * bs
        rest = tokens[start:min(limit, start + bs)]
        if rest:
            for b in self.children.get(parent, ()):
                n = common_prefix_len(self.tokens_of[b], rest, len(rest))
                if n > hit.copy_rows:
                    hit.copy_from, hit.copy_rows = b, n
        return hit

    def record(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes | None:
        """Note that `tokens` had their KV written, in order, into `block` (under `parent`).

        Returns the block's chain hash when this filled it, else None."""
        if not self.caching:
            return None
        held = self.tokens_of[block]
        if not held:
            self.parent_of[block] = parent
            self.children.setdefault(parent, set()).add(block)
        held.extend(tokens)
        if len(held) < self.block_size:
            return None
        h = chain_hash(parent, held)
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hash_of[block] = h
        return h
