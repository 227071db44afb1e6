import torch

from genlm_core import OutputCache, Request


def test_lru_by_entries():
    c = OutputCache(maxsize=2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now most recent
    c.put("c", 3)
    assert "b" not in c and c.get("a") == 1 and c.get("c") == 3
    assert (c.hits, c.misses) == (3, 0)
    assert c.get("b") is None and c.misses == 1


def test_lru_by_bytes_keeps_newest():
    c = OutputCache(maxsize=100, max_bytes=3 * 400)
    for i in range(5):
        c.put(i, torch.zeros(100))  # 400 bytes each
    assert len(c) == 3 and c.nbytes == 1200 and 0 not in c and 4 in c
    c.put("big", torch.zeros(1000))  # larger than the bound: kept alone
    assert len(c) == 1 and "big" in c and c.nbytes == 4000


def test_replacing_a_key_updates_bytes():
    c = OutputCache(max_bytes=None)
    c.put("k", torch.zeros(10))
    c.put("k", torch.zeros(20))
    assert len(c) == 1 and c.nbytes == 80
    c.clear()
    assert len(c) == 0 and c.nbytes == 0


def test_zero_size_stores_nothing():
    c = OutputCache(maxsize=0)
    c.put("k", 1)
    assert len(c) == 0


def test_move_to_cpu_and_keys_with_adapter():
    c = OutputCache(move_to_cpu=True)
    t = torch.ones(3)
    c.put(Request((1, 2), None), t)
    c.put(Request((1, 2), "lora-a"), t * 2)
    assert c.get(Request((1, 2), None)).device.type == "cpu"
    assert c.get(Request((1, 2), "lora-a"))[0] == 2  # the adapter is part of the key
