"""Direct tests of the longest-prefix LRU (PrefixCache) and the batch layout (plan_batch)."""

from __future__ import annotations

import numpy as np
import pytest

from genlm_core.kv_reuse import KVBlock, KVRow, pack_shared, plan_batch, plan_merged
from genlm_core.prefix_cache import PrefixCache


class Block:
    """A stand-in for a KV block: identity is what the cache tracks."""

    def __init__(self, name):
        self.name = name


def test_longest_prefix_prefers_the_longest_and_respects_namespaces_and_max_length():
    cache = PrefixCache()
    b = Block("b")
    cache.put(None, (1,), "1", b, 10)
    cache.put(None, (1, 2, 3), "123", b, 10)
    cache.put("lora", (1, 2, 3, 4), "lora 1234", b, 10)
    assert cache.longest_prefix(None, (1, 2, 3, 4)).value == "123"
    assert cache.longest_prefix(None, (1, 2, 3, 4), max_length=2).value == "1"
    assert cache.longest_prefix("lora", (1, 2, 3, 4)).value == "lora 1234"
    assert cache.longest_prefix(None, (2, 1)) is None
    assert (cache.hits, cache.misses) == (3, 1)


def test_bytes_are_counted_once_per_shared_block_and_freed_with_its_last_entry():
    cache = PrefixCache()
    shared, other = Block("shared"), Block("other")
    cache.put(None, (1,), "a", shared, 100)
    cache.put(None, (2,), "b", shared, 100)  # the same block: its bytes count once
    cache.put(None, (3,), "c", other, 50)
    assert cache.nbytes == 150 and len(cache) == 3
    cache.put(None, (1,), "a2", other, 50)  # replacing an entry moves it to another block
    assert cache.nbytes == 150
    cache.put(None, (2,), "b2", other, 50)  # the shared block's last entry gone: its bytes freed
    assert cache.nbytes == 50
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0 and cache.longest_prefix(None, (1,)) is None


def test_eviction_is_least_recently_used_by_entries():
    cache = PrefixCache(max_entries=2)
    blocks = [Block(i) for i in range(4)]
    cache.put(None, (1,), "1", blocks[0], 1)
    cache.put(None, (2,), "2", blocks[1], 1)
    assert cache.longest_prefix(None, (1, 9)).value == "1"  # a hit makes (1,) recent
    cache.put(None, (3,), "3", blocks[2], 1)  # evicts (2,), the least recently used
    assert cache.longest_prefix(None, (2,)) is None
    assert cache.longest_prefix(None, (1,)).value == "1" and cache.longest_prefix(None, (3,)).value == "3"


def test_eviction_by_bytes_keeps_the_newest_block_even_when_it_alone_is_over_the_bound():
    cache = PrefixCache(max_bytes=100)
    old, big = Block("old"), Block("big")
    cache.put(None, (1,), "old", old, 60)
    cache.put(None, (2,), "big 1", big, 500)
    cache.put(None, (3,), "big 2", big, 500)
    assert cache.longest_prefix(None, (1,)) is None  # evicted for bytes
    assert cache.longest_prefix(None, (2,)).value == "big 1" and cache.longest_prefix(None, (3,)).value == "big 2"
    assert cache.nbytes == 500  # over the bound: the batch just stored survives to be extended
    cache.put(None, (4,), "next", Block("next"), 10)  # a newer block: now the big one can go
    assert cache.nbytes == 10 and cache.longest_prefix(None, (2,)) is None


def make_block(rows, length, mask=None):
    kv = [(np.zeros((rows, 1, length, 2)), np.zeros((rows, 1, length, 2)))]
    mask = np.ones((rows, length), bool) if mask is None else np.asarray(mask, bool)
    return KVBlock(kv, mask, mask)


def test_plan_batch_left_pads_new_tokens_with_real_positions_and_groups_by_block():
    a, b = make_block(2, 5), make_block(1, 3)
    rows = [
        KVRow((1, 2, 3, 4, 5, 6), done=5, entry=(a, 1)),  # one new token after 5 cached
        KVRow((7, 8, 9, 10, 11), done=3, entry=(b, 0)),  # two new tokens after 3 cached
        KVRow((12, 13, 14)),  # nothing cached: three new tokens
        KVRow((1, 2, 3, 4, 5, 20), done=5, entry=(a, 0)),
    ]
    plan = plan_batch(rows)
    assert plan.width == 3 and plan.past_length == 5
    np.testing.assert_array_equal(plan.input_ids, [[0, 0, 6], [0, 10, 11], [12, 13, 14], [0, 0, 20]])
    np.testing.assert_array_equal(plan.new_mask, [[0, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    np.testing.assert_array_equal(plan.positions, [[0, 0, 5], [0, 3, 4], [0, 1, 2], [0, 0, 5]])
    assert [(g[0] is a, g[1], g[2]) for g in plan.groups] == [(True, [0, 3], [1, 0]), (False, [1], [0])]
    assert plan.reuses_whole_block() is None and plan.tree is None
    assert plan.outputs == [(0, 2), (1, 2), (2, 2), (3, 2)]


@pytest.mark.parametrize(("sources", "whole"), [([0, 1], True), ([1, 0], False), ([0, 0], False)])
def test_plan_batch_detects_batches_that_are_one_blocks_rows(sources, whole):
    block = make_block(2, 4)
    rows = [KVRow((1, 2, 3, 4, 9 + i), done=4, entry=(block, src)) for i, src in enumerate(sources)]
    assert (plan_batch(rows).reuses_whole_block() is block) == whole
    packed_entry = [KVRow((1, 2, 3, 4, 9 + i), done=4, entry=(block, i, np.arange(4))) for i in range(2)]
    assert plan_batch(packed_entry).reuses_whole_block() is None  # a packed row's entry is part of its row


def test_pack_shared_runs_each_shared_token_once_and_plans_a_tree():
    block = make_block(1, 2)
    sequences = [(1, 2, 5), (1, 2, 5, 6), (1, 2, 5, 7), (1, 2, 8), (3, 4)]
    rows = [KVRow(ids, done=2, entry=(block, 0)) for ids in sequences[:4]] + [KVRow(sequences[4])]
    packed, where = pack_shared(rows, limit=16)
    assert len(packed) == 2 and packed[1] is rows[4]
    tokens, parents = packed[0].tree
    assert tokens == (5, 6, 7, 8) and parents == (-1, 0, 0, -1)  # 5 runs once for three sequences
    assert where == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1)]
    assert [packed[0].ancestors(j) for j in range(4)] == [[0], [0, 1], [0, 2], [3]]
    plan = plan_batch(packed, where)
    np.testing.assert_array_equal(plan.input_ids, [[5, 6, 7, 8], [0, 0, 3, 4]])
    np.testing.assert_array_equal(plan.positions, [[2, 3, 3, 2], [0, 0, 0, 1]])
    sees = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]]
    np.testing.assert_array_equal(plan.tree[0], sees)
    np.testing.assert_array_equal(plan.tree[1], [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
    assert plan.outputs == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3)]
    # nothing shared, or a tree over the limit: one row per sequence, as without packing
    assert pack_shared(rows[3:], limit=16)[0] == rows[3:]
    assert pack_shared(rows, limit=3)[0] == rows


def test_plan_merged_keeps_each_shared_prefix_token_once_and_shows_each_sequence_its_own():
    """A beam's sequences share long prefixes held in different blocks: merged, the past holds each
    distinct prefix token once, and every new token sees exactly its own sequence's prefix."""
    shared = tuple(range(10, 110))  # 100 cached tokens common to every sequence
    a = make_block(2, 103, [[0] * 2 + [1] * 101, [0] + [1] * 102])  # (shared, 1) at row 0; (shared, 2, 3) row 1
    b = make_block(1, 101)  # (shared, 4)
    rows = [
        KVRow((*shared, 1, 7), done=101, entry=(a, 0)),
        KVRow((*shared, 2, 3, 8, 9), done=102, entry=(a, 1)),
        KVRow((*shared, 4, 6), done=101, entry=(b, 0)),
    ]
    plan = plan_merged(rows)
    m = plan.merged
    assert m is not None and m.length == 100 + 4  # shared once, then 1; 2, 3; 4
    np.testing.assert_array_equal(plan.input_ids, [[7, 8, 9, 6]])
    np.testing.assert_array_equal(plan.positions, [[101, 102, 103, 101]])
    assert m.offsets == [0, 1, 3] and plan.outputs == [(0, 0), (0, 2), (0, 3)]
    np.testing.assert_array_equal(m.prefixes[0], [*range(100), 100])
    np.testing.assert_array_equal(m.prefixes[1], [*range(100), 101, 102])
    np.testing.assert_array_equal(m.prefixes[2], [*range(100), 103])
    for j, own in enumerate([0, 1, 1, 2]):
        np.testing.assert_array_equal(np.flatnonzero(m.seen[j]), m.prefixes[own])
    np.testing.assert_array_equal(plan.tree[0], [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]])
    # every merged position comes from exactly one source column holding that very prefix
    at = {int(p): (blk, row, int(c)) for blk, row, cols, pos in m.sources for c, p in zip(cols, pos)}
    assert sorted(at) == list(range(104))
    assert at[100] == (a, 0, 102) and at[101] == (a, 1, 101) and at[102] == (a, 1, 102) and at[103] == (b, 0, 100)
    assert at[0] == (a, 0, 2)  # the first source of the shared prefix: a's row 0, after its holes


def test_plan_merged_lists_only_sources_that_add_positions():
    """A sequence whose whole prefix is in an earlier row's (here: a prefix of it, stored in another
    block) takes every past position from that row: its own block is no source."""
    shared = tuple(range(10, 110))
    a = make_block(1, 102)  # (shared, 1, 2)
    b = make_block(1, 101)  # (shared, 1): the same tokens, computed in another batch
    rows = [KVRow((*shared, 1, 2, 7), done=102, entry=(a, 0)), KVRow((*shared, 1, 8), done=101, entry=(b, 0))]
    m = plan_merged(rows).merged
    assert m.length == 102 and [(blk, row) for blk, row, _, _ in m.sources] == [(a, 0)]
    np.testing.assert_array_equal(m.prefixes[1], range(101))


def test_plan_merged_declines_when_rows_share_little_or_reuse_one_block():
    """Particles of an SMC step (one new token each after pasts that share only a prompt) keep the
    padded layout: merging would attend over every particle's past for every token."""
    block = make_block(8, 60)
    prompt = tuple(range(1, 21))
    rows = [KVRow((*prompt, *range(100 * i, 100 * i + 40), 5), done=60, entry=(block, i)) for i in range(8)]
    assert plan_merged(rows) is None
