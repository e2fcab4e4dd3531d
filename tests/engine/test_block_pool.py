"""Block accounting of the paged KV cache (cluster.engine.scheduling.block_pool), on its own."""

import pytest

from cluster.engine.scheduling.block_pool import BlockPool, BlockTable, OutOfBlocks
from cluster.engine.scheduling.hashing import block_hashes


def pool(n=8, bs=4):
    return BlockPool(n, bs, seed=1)


def test_blocks_come_back_after_release():
    p, t = pool(), BlockTable()
    p.grow(t, 10)
    assert len(t.blocks) == 3 and p.num_used == 3
    p.release(t)
    assert p.num_used == 0 and p.num_free == 8 and not t.blocks


def test_grow_past_the_pool_allocates_nothing():
    p, t = pool(4), BlockTable()
    p.grow(t, 8)
    with pytest.raises(OutOfBlocks):
        p.grow(t, 20)
    assert len(t.blocks) == 2 and p.num_used == 2


def test_shrink_gives_back_the_drafts_blocks():
    p, t = pool(), BlockTable()
    p.grow(t, 5 + 8)  # 5 accepted tokens and room for 8 drafts
    assert len(t.blocks) == 4
    p.shrink(t, 6)
    assert len(t.blocks) == 2 and p.num_used == 2


def test_prefix_is_shared_by_reference_and_checked_by_tokens():
    p = pool()
    toks = list(range(10, 23))  # 13 tokens: 3 full blocks
    a = BlockTable()
    p.grow(a, len(toks))
    p.commit(a, toks, len(toks))
    assert a.hashes == block_hashes(toks, 4, 1)
    b = BlockTable()
    assert p.match_prefix(b, toks) == 12 and b.blocks == a.blocks[:3]
    assert [p.refs[x] for x in a.blocks[:3]] == [2, 2, 2]
    # the whole prompt cached: the last full block is left to recompute (never written shared)
    c = BlockTable()
    assert p.match_prefix(c, toks[:12]) == 8
    # a forged entry (right hash, other tokens) is never served
    p.block_tokens[a.blocks[0]] = (0, 0, 0, 0)
    d = BlockTable()
    assert p.match_prefix(d, toks) == 0 and not d.blocks
    for t in (a, b, c, d):
        p.release(t)
    assert p.num_used == 0 and p.num_cached_free == 3 == sum(x in p.block_hash for x in p.free)


def test_freed_blocks_stay_cached_until_reused_lru_and_report_it():
    p = pool(6)
    events = []
    p.on_change = lambda stored, evicted: events.append((stored, evicted))
    toks = list(range(8))
    a = BlockTable()
    p.grow(a, 8)
    p.commit(a, toks, 8)
    p.release(a)
    assert events == [(block_hashes(toks, 4, 1), [])]
    hit = BlockTable()
    assert p.match_prefix(hit, toks + [99]) == 8  # still cached after its owner left
    p.release(hit)
    big = BlockTable()
    p.grow(big, 4 * 5)  # 4 never-used blocks, then the oldest freed: the chain's tail
    assert events[-1] == ([], [block_hashes(toks, 4, 1)[1]])
    assert p.hashes() == [block_hashes(toks, 4, 1)[0]]
    p.release(big)
    assert p.num_used == 0 and p.num_cached_free == 1 == sum(x in p.block_hash for x in p.free)


def test_blocks_cached_twice_keep_one_copy():
    p, toks = pool(), list(range(4))
    a, b = BlockTable(), BlockTable()
    for t in (a, b):
        p.grow(t, 5)
        p.commit(t, toks + [0], 4)
    assert len(p.hashes()) == 1 and a.hashes == b.hashes
    p.release(a)
    p.release(b)
    assert p.num_used == 0
