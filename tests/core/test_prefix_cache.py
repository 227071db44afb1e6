"""Direct tests of the longest-prefix LRU (PrefixCache); the KV-reuse layout is tested in test_kv_reuse.py."""

from __future__ import annotations

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


def test_handles_lists_and_tuples_of_one_sequence_are_one_entry():
    """Random sequences stored and looked up in every form: each lookup finds the entry of the longest
    stored prefix (brute force over what was stored), whatever form stored it or asks."""
    import random

    from genlm_core.context import CHUNK, Context

    rng = random.Random(2)
    cache: PrefixCache[int] = PrefixCache(max_entries=10_000)
    block = Block("b")
    stored: dict[tuple[int, ...], int] = {}
    root = Context([rng.randrange(50) for _ in range(CHUNK + 5)], 50)
    contexts = [root]
    for i in range(300):
        ctx = rng.choice(contexts).extend(rng.randrange(50))
        contexts.append(ctx)
        form = rng.choice([ctx, tuple(ctx), list(ctx)])
        if rng.random() < 0.4:
            cache.put(None, form, i, block, 1)
            stored[tuple(ctx)] = i
        hit = cache.longest_prefix(None, form, len(ctx) - 1)
        best = max((n for n in range(1, len(ctx)) if tuple(ctx)[:n] in stored), default=None)
        assert (hit is None and best is None) or (hit.length == best and hit.value == stored[tuple(ctx)[:best]])
