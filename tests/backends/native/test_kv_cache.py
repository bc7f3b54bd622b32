"""BlockPool bookkeeping: allocation, reference counts, LRU eviction, hash chains, invalidation."""

from __future__ import annotations

import pytest

from hybridrl.backends.native.kv_cache import BlockPool, chain_hash, common_prefix_len

pytestmark = pytest.mark.timeout(120)


def fill(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocate blocks for tokens and record them as computed, like a finished prefill."""
    bs = pool.block_size
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    chain: list[bytes] = []
    for j, b in enumerate(blocks):
        h = pool.record(b, chain[-1] if chain else pool.salt, tokens[j * bs:(j + 1) * bs])
        if h is not None:
            chain.append(h)
    return blocks, chain


def test_allocate_release_and_refcounts():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert pool.num_available == 1 and pool.num_used == 3
    with pytest.raises(RuntimeError, match="2 blocks requested, 1 available"):
        pool.allocate(2)
    pool.pin(a[0])
    pool.release(a)
    assert pool.ref[a[0]] == 1 and pool.num_available == 3    # unrecorded blocks go straight back to free


def test_full_blocks_are_shared_and_the_partial_tail_is_offered_for_copy():
    pool = BlockPool(16, 4)
    tokens = list(range(10, 21))                    # 11 tokens: 2 full blocks + 3 in the third
    blocks, chain = fill(pool, tokens)
    assert chain == [chain_hash(pool.salt, tokens[:4]), chain_hash(chain_hash(pool.salt, tokens[:4]), tokens[4:8])]
    hit = pool.lookup(tokens + [99], limit=11)      # same prompt + more: both full blocks, 3 rows to copy
    assert hit.blocks == blocks[:2] and hit.chain == chain
    assert hit.copy_from == blocks[2] and hit.copy_rows == 3 and hit.num_tokens(4) == 11
    hit = pool.lookup(tokens, limit=10)             # a prompt must recompute at least its last token
    assert hit.num_tokens(4) == 10
    hit = pool.lookup(tokens[:5] + [7, 7, 7, 7], limit=8)   # diverges inside the second block
    assert hit.blocks == blocks[:1] and hit.copy_from == blocks[1] and hit.copy_rows == 1
    assert pool.lookup([1, 2, 3, 4, 5], limit=4).num_tokens(4) == 0


def test_released_blocks_stay_cached_until_evicted_tail_first():
    pool = BlockPool(4, 2)
    blocks, chain = fill(pool, [1, 2, 3, 4, 5, 6])
    pool.release(reversed(blocks))
    assert pool.num_available == 4 and len(pool.evictable) == 3
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7], limit=6).blocks == blocks
    pool.allocate(2)                                # the free block, then the LRU cached block: the tail
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7], limit=6).blocks == blocks[:2]


def test_duplicate_content_is_not_registered_twice():
    pool = BlockPool(8, 2)
    first, _ = fill(pool, [1, 2, 3, 4])
    second, _ = fill(pool, [1, 2, 3, 4])
    assert pool.lookup([1, 2, 3, 4, 0], limit=4).blocks == first
    pool.release(reversed(first))
    pool.release(reversed(second))
    assert pool.lookup([1, 2, 3, 4, 0], limit=4).blocks == first


def test_invalidate_forgets_everything_and_changes_the_salt():
    pool = BlockPool(8, 2)
    blocks, _ = fill(pool, [1, 2, 3, 4, 5])
    salt = pool.salt
    pool.release(reversed(blocks))
    pool.invalidate()
    assert pool.salt != salt and not pool.by_hash and not pool.children and not pool.evictable
    assert pool.num_available == 8
    assert pool.lookup([1, 2, 3, 4, 5, 6], limit=5).num_tokens(2) == 0


def test_disabled_caching_never_hits():
    pool = BlockPool(8, 2, enable_prefix_caching=False)
    blocks, chain = fill(pool, [1, 2, 3, 4])
    assert chain == []
    pool.release(blocks)
    assert pool.lookup([1, 2, 3, 4, 5], limit=4).num_tokens(2) == 0 and len(pool.free) == 8


def test_common_prefix_len():
    a = list(range(200))
    assert common_prefix_len(a, a, 150) == 150
    assert common_prefix_len(a, a[:70] + [-1], 500) == 70
    assert common_prefix_len(a, [], 5) == 0
