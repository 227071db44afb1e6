"""Token-character tries: every engine against brute force, precision, real vocabularies, async."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_core import Token, decode_vocab
from genlm_core.bytes import AsyncTokenByteTrie, TrieMode
from genlm_core.plugins import get_plugins
from genlm_core.testing import bounds
from genlm_core.trie import END, AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

ENGINES = [TokenCharacterTrie, lambda vocab: ParallelTokenCharacterTrie(vocab, device="cpu")]
ENGINE_IDS = ["numba", "torch-cpu"]


def brute_force(trie, ws, op):
    """Node values from the definition: reduce over tokens whose bytes start with the node's prefix.
    Sums are ``math.fsum``: correctly rounded, so off the exact sum by at most ``U64 * sum``."""
    reduce = max if op == "max" else math.fsum
    out = []
    for node, prefix in enumerate(trie.node2prefix):
        token = int(trie.index.node_token[node])
        if token >= 0:
            out.append(float(ws[token]))
        else:
            out.append(float(reduce(w for t, w in zip(trie.decode, ws) if t.startswith(prefix))))
    return np.array(out)


def sum_bound(trie, want, computations=1):
    """Tolerance of ``computations`` engine sums (1: against the correctly rounded :func:`brute_force`,
    which adds ``U64 * S``; 2: two engines against each other) of nonnegative float64 weights whose node
    sums are ``want``: each engine is off by at most :func:`bounds.tree_sum_error` (per node, from the
    roundings its sums can meet, in any order: any thread count or batch split)."""
    err = bounds.tree_sum_error(trie.index.parent, trie.index.depth, want)
    return computations * err + (bounds.U64 * np.abs(want) if computations == 1 else 0.0)


SUM_BASIS = "float64 trie sums in any order (tree_sum_error) + a correctly rounded fsum reference"


vocabs = st.lists(st.binary(max_size=5), min_size=1, max_size=40).flatmap(
    lambda v: st.just(v + v[: len(v) // 4])  # some duplicate byte strings
)


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=vocabs)
def test_matches_brute_force(make, data, vocab):
    trie = make(vocab)
    n = len(vocab)
    probs = np.array(data.draw(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=n, max_size=n)))
    logs = np.array(data.draw(st.lists(st.floats(-50, -1e-3) | st.just(-np.inf), min_size=n, max_size=n)))
    want = brute_force(trie, probs, "sum")
    bounds.within_each("trie: sum vs brute force", trie.weight_sum(probs), want, sum_bound(trie, want), SUM_BASIS)
    # log-space weights are all negative: a max that starts from 0 would be wrong here
    np.testing.assert_array_equal(trie.weight_max(logs), brute_force(trie, logs, "max"))


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_structure_and_maps(make):
    vocab = [Token(0, b"ab"), Token(1, b"a"), Token(2, b"ab"), Token(3, b""), Token(4, b"b")]
    trie = make(vocab)
    # duplicate byte strings each get their own leaf
    leaves = trie.token_id_to_leaf
    assert len(set(leaves.tolist())) == 5
    assert {trie.leaf2token_id[int(leaf)] for leaf in leaves} == {0, 1, 2, 3, 4}
    assert trie.node2prefix[trie.node_of_prefix(b"ab")] == b"ab"
    assert trie.node_of_prefix(b"abc") is None
    assert trie.children[trie.node_of_prefix(b"a")][ord("b")] == trie.node_of_prefix(b"ab")
    assert trie.children[trie.root][END] == leaves[3]  # the empty token hangs off the root
    for node in range(trie.num_nodes):  # every subtree is a contiguous range of node numbers
        inside = range(node, int(trie.index.subtree_end[node]))
        assert all(trie.node2prefix[m].startswith(trie.node2prefix[node]) for m in inside)
    ws = np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    sums = trie.weight_sum(ws)
    tol = sum_bound(trie, sums)
    for prefix, members in ((b"", [0, 1, 2, 3, 4]), (b"ab", [0, 2]), (b"a", [0, 1, 2])):
        node = trie.node_of_prefix(prefix)
        want = math.fsum(ws[members])  # 1.0, 0.4, 0.6 up to the decimal literals' rounding
        bounds.within(f"trie: {prefix!r} mass", abs(sums[node] - want), bounds.Bound(tol[node], SUM_BASIS))


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_tiny_subtree_next_to_large_mass_keeps_relative_precision(make):
    vocab = [b"a", b"b", b"bx", b"by", b"bz", b"c"]
    ws = np.array([1.0 - 3e-30, 1e-30, 7e-31, 2e-31, 1e-31, 1e-300])
    trie = make(vocab)
    sums = trie.weight_sum(ws)
    b = trie.node_of_prefix(b"b")
    expected_b = math.fsum(ws[1:5])
    # a tolerance relative to the node's own mass (about 2e-45 here), not to the root's 1.0
    bounds.within("trie: tiny subtree", abs(sums[b] - expected_b), bounds.Bound(sum_bound(trie, sums)[b], SUM_BASIS))
    assert sums[trie.node_of_prefix(b"c")] == 1e-300  # one token: no addition, exact


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_inputs_numpy_torch_batched_and_lists(make):
    trie = make([b"a", b"b", b"ab"])
    w = np.array([0.2, 0.3, 0.5], np.float32)
    single = trie.weight_sum(w)
    # exact: float32 widens to float64 exactly, and each row is summed in the same order alone or in a batch
    for ws in (torch.tensor(w), w.astype(np.float64), torch.tensor(w, dtype=torch.float64)):
        np.testing.assert_array_equal(trie.weight_sum(ws), single)
    batch = np.stack([w, w[::-1].copy()])
    for b in (batch, torch.tensor(batch), [batch[0], batch[1]], [torch.tensor(batch[0]), torch.tensor(batch[1])]):
        out = trie.batch_weight_sum(b)
        assert out.shape == (2, trie.num_nodes)
        np.testing.assert_array_equal(out[0], single)
        np.testing.assert_array_equal(out[1], trie.weight_sum(batch[1]))


@pytest.mark.parametrize("make", ENGINES, ids=ENGINE_IDS)
def test_bad_inputs_are_clear_errors(make):
    trie = make([b"a", b"b"])
    with pytest.raises(ValueError, match=r"one weight vector of shape \(2,\), got \(3,\)"):
        trie.weight_sum(np.ones(3))
    with pytest.raises(ValueError, match=r"shape \(2,\) or \(batch, 2\), got \(2, 3\)"):
        trie.batch_weight_sum(np.ones((2, 3)))
    with pytest.raises(ValueError, match="token 1 is nan"):
        trie.weight_sum(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="token 0 is inf"):
        trie.weight_max(torch.tensor([np.inf, 0.0]))
    with pytest.raises(ValueError, match=r"token 1 is -inf: weights must be finite$"):
        trie.weight_sum(np.array([0.5, -np.inf]))
    assert trie.weight_max(np.array([-np.inf, -2.0]))[trie.root] == -2.0  # -inf is a log-space zero
    with pytest.raises(TypeError, match="weights must be"):
        trie.weight_sum("nope")
    with pytest.raises(ValueError, match="empty vocabulary"):
        make([])
    with pytest.raises(TypeError, match="must be bytes"):
        make(["a"])


@pytest.fixture(scope="module", params=["mistral-v1", "tekken"])
def real_vocab(request):
    from genlm_core.testing.tokenizers import load_tokenizer

    return decode_vocab(load_tokenizer(request.param))[0]


def test_engines_agree_on_real_vocabularies(real_vocab):
    cpu = TokenCharacterTrie(real_vocab)
    par = ParallelTokenCharacterTrie(real_vocab, device="cpu", index=cpu.index)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, len(real_vocab), generator=gen, dtype=torch.float64) * 4
    probs, logs = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    sums, maxs = cpu.batch_weight_sum(probs), cpu.batch_weight_max(logs)
    bounds.within_each(
        "trie: torch vs numba engine, real vocabulary",
        par.batch_weight_sum(probs),
        sums,
        sum_bound(cpu, sums, computations=2),
        "two float64 trie sums in any order: 2 x tree_sum_error",
    )
    np.testing.assert_array_equal(par.batch_weight_max(logs), maxs)  # a max rounds nothing
    tol = sum_bound(cpu, sums)
    for row in range(3):
        total = math.fsum(probs[row].tolist())  # 1 up to the float64 softmax's own rounding
        bounds.within(
            "trie: root = total mass", abs(sums[row, cpu.root] - total), bounds.Bound(tol[row, cpu.root], SUM_BASIS)
        )
    # spot-check nodes against brute force over the whole vocabulary
    rng = np.random.default_rng(0)
    nodes = rng.choice(cpu.num_nodes, 40, replace=False)
    starts = {n: cpu.node2prefix[n] for n in nodes}
    p0, l0 = probs[0].double().numpy(), logs[0].double().numpy()
    for n, prefix in starts.items():
        token = int(cpu.index.node_token[n])
        members = [token] if token >= 0 else [i for i, t in enumerate(real_vocab) if t.startswith(prefix)]
        want = math.fsum(p0[members])
        bounds.within(
            "trie: node vs brute force, real vocabulary", abs(sums[0, n] - want), bounds.Bound(tol[0, n], SUM_BASIS)
        )
        assert maxs[0, n] == l0[members].max()  # a max rounds nothing


def test_visualize():
    pytest.importorskip("graphviz", reason="visualize is optional: needs the graphviz package")
    trie = TokenCharacterTrie([b"a", b"ab"])
    src = trie.visualize(np.array([0.25, 0.75])).source
    assert "token 0" in src and "0.75" in src and "label=b" in src
    with pytest.raises(ValueError, match="max_nodes"):
        TokenCharacterTrie([bytes([i]) for i in range(256)] * 3).visualize(max_nodes=10)


def test_engines_registered_through_the_hook():
    engines = get_plugins().trie_engines()
    assert engines["numba"].load() is TokenCharacterTrie
    assert engines["torch"].load() is ParallelTokenCharacterTrie
    assert get_plugins().trie_engine("parallel").name == "torch"  # seed-compatible aliases
    assert get_plugins().trie_engine("sequential").name == "numba"


@pytest.mark.parametrize("backend", ["numba", "parallel"])
async def test_async_trie_batches_and_matches(backend):
    vocab = [b"a", b"ab", b"b", b"ba", b"bb"]
    trie = AsyncTokenCharacterTrie.from_vocab(
        vocab, backend=backend, batch_size=4, **({"device": "cpu"} if backend == "parallel" else {})
    )
    rng = np.random.default_rng(1)
    ws = [rng.random(5) for _ in range(10)]
    sums = await asyncio.gather(*(trie.weight_sum(w) for w in ws))
    maxs = await asyncio.gather(*(trie.weight_max(np.log(w)) for w in ws))
    for w, s, m in zip(ws, sums, maxs):  # exact: the engine sums each row of a batch in the same order
        np.testing.assert_array_equal(s, trie.trie.weight_sum(w))
        np.testing.assert_array_equal(m, trie.trie.weight_max(np.log(w)))
    assert max(trie.batcher.stats.sizes) <= 4 and trie.batcher.stats.batches >= 5  # capped batches
    trie.cleanup()


async def test_async_trie_bad_input_fails_alone_and_batches_survive_errors(monkeypatch):
    trie = AsyncTokenCharacterTrie.from_vocab([b"a", b"b"], batch_size=8)
    with pytest.raises(ValueError, match="shape"):
        await trie.weight_sum(np.ones(5))
    good = np.array([0.5, 0.5])
    real_reduce = trie.trie._reduce
    calls = {"n": 0}

    def flaky(ws, op):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine hiccup")
        return real_reduce(ws, op)

    monkeypatch.setattr(trie.trie, "_reduce", flaky)
    results = await asyncio.gather(trie.weight_sum(good), trie.weight_sum(good * 2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    out = await trie.weight_sum(good)  # the next batch works
    assert out[trie.trie.root] == 1.0  # 0.5 + 0.5: exact
    trie.cleanup()


async def test_async_trie_same_vector_computed_once():
    trie = AsyncTokenCharacterTrie.from_vocab([b"a", b"b"], batch_size=8)
    w = np.array([0.25, 0.75])
    a, b = await asyncio.gather(trie.weight_sum(w), trie.weight_sum(w))
    assert a is b and trie.batcher.stats.items == 1
    trie.cleanup()


async def test_both_async_tries_keep_each_operation_on_one_vector_apart_in_one_batch():
    """Every operation on the same vector, submitted together: one batch, and each result is its own
    operation's (against brute force, and the byte trie's unbatched methods)."""
    vocab = [b"a", b"ab", b"b", b"ba", b"bb"]
    w = np.random.default_rng(2).random(5)
    char = AsyncTokenCharacterTrie.from_vocab(vocab, batch_size=8, timeout=0.005)
    sums, maxs = await asyncio.gather(char.weight_sum(w), char.weight_max(w))
    want = brute_force(char.trie, w, "sum")
    bounds.within_each("trie: async sum vs brute force", sums, want, sum_bound(char.trie, want), SUM_BASIS)
    np.testing.assert_array_equal(maxs, brute_force(char.trie, w, "max"))
    assert (char.batcher.stats.batches, char.batcher.stats.items) == (1, 2)
    char.cleanup()
    byte = AsyncTokenByteTrie.from_vocab(vocab, eos_byte_strings=[b"b"], batch_size=8, timeout=0.005)
    without, with_eos, maxs = await asyncio.gather(
        byte.weight_sum(w), byte.weight_sum(w, TrieMode.WITH_EOS), byte.weight_max(w)
    )
    # exact: one batch or alone, the same sums in the same order
    np.testing.assert_array_equal(without, byte.trie.weight_sum(w))
    np.testing.assert_array_equal(with_eos, byte.trie.weight_sum(w, TrieMode.WITH_EOS))
    np.testing.assert_array_equal(maxs, byte.trie.weight_max(w))
    assert with_eos[byte.trie.eos_node] == w[2] and without[byte.trie.eos_node] == 0  # one token: exact
    assert (byte.batcher.stats.batches, byte.batcher.stats.items) == (1, 3)
    byte.cleanup()


def test_output_buffers_are_reused_only_when_no_result_views_them():
    trie = TokenCharacterTrie([b"a", b"b", b"ab"])
    first = trie.weight_sum(np.array([0.2, 0.3, 0.5]))
    kept = first.copy()
    second = trie.weight_sum(np.array([0.5, 0.25, 0.25]))  # `first` is alive: fresh memory
    np.testing.assert_array_equal(first, kept)
    assert not np.shares_memory(first, second)
    address = second.__array_interface__["data"][0]
    del second
    third = trie.batch_weight_sum(np.array([[0.1, 0.1, 0.8]]))
    assert third.__array_interface__["data"][0] == address  # dropped result's memory recycled
    np.testing.assert_array_equal(first, kept)


def test_output_pool_calibrates_its_free_count_and_turns_off_where_counts_cannot_tell(monkeypatch):
    from genlm_core.trie import cpu

    pool = cpu.OutputPool()
    assert pool.free_count is not None  # CPython: calibrated, not assumed
    a = pool.empty(2, 3)
    row = a[0]  # a view of the result keeps its memory taken
    del a
    b = pool.empty(2, 3)
    assert not np.shares_memory(row, b)
    monkeypatch.setattr(cpu, "_free_count", lambda: None)  # e.g. another interpreter
    off = cpu.OutputPool()
    off.empty(2, 3)
    off.empty(2, 3)
    assert off.free_count is None and off._buffers == []  # nothing kept, so nothing can be handed out twice
