"""genlm-backend / genlm-bytes names and signatures that genlm keeps (see docs/migration.md)."""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import torch

from genlm_core import Token, decode_vocab
from genlm_core.bytes import AsyncTokenByteTrie, BeamParams, TokenByteTrie, TrieMode
from genlm_core.closing import Closed
from genlm_core.errors import BatcherError, ClosedError
from genlm_core.testing import bounds
from genlm_core.testing.tokenizers import load_tokenizer
from genlm_core.trie import AsyncTokenCharacterTrie

from .helpers import BigramLM


@pytest.fixture
def lm(toy_tok):
    return BigramLM(toy_tok, batch_size=4, timeout=10.0, flush="timeout")  # queued requests wait for the timeout


@pytest.mark.parametrize("name", ["gpt2", "mistral-v1"])
def test_byte2str_fallbacks(name):
    """Valid UTF-8 decodes as itself; the rest follows the chosen fallback."""
    tok = load_tokenizer(name)
    byte_vocab, default = decode_vocab(tok)
    assert default == decode_vocab(tok, byte2str_fallback="tokenizer")[1]
    latin1 = decode_vocab(tok, byte2str_fallback="latin1")[1]
    replace = decode_vocab(tok, "replace")[1]
    invalid = 0
    for i, t in enumerate(byte_vocab):
        try:
            text = bytes(t).decode("utf-8")
        except UnicodeDecodeError:
            invalid += 1
            assert default[i] == tok.convert_ids_to_tokens(i)
            assert latin1[i] == bytes(t).decode("latin-1") and replace[i] == bytes(t).decode("utf-8", "replace")
        else:
            assert default[i] == latin1[i] == replace[i] == text
    assert invalid > 100  # GPT-2: 344 partial UTF-8 tokens; Llama-2: 128 byte-fallback pieces
    with pytest.raises(ValueError, match="byte2str_fallback"):
        decode_vocab(tok, byte2str_fallback="ascii")


def test_lm_str_vocab_keeps_the_tokenizers_piece():
    from genlm_core.mock import MockAsyncLM

    lm = MockAsyncLM.from_name("gpt2")
    tok = lm.tokenizer
    bad = [i for i, t in enumerate(lm.byte_vocab) if not _utf8(t)]
    assert len(bad) == 344 and all(lm.str_vocab[i] == tok.convert_ids_to_tokens(i) for i in bad)
    assert "\ufffd" not in {lm.str_vocab[i] for i in bad}


def _utf8(b: bytes) -> bool:
    try:
        bytes(b).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_uncached_equals_cached_and_touches_no_cache(lm):
    row = lm.next_token_logprobs_uncached([3, 4])
    assert len(lm.cache) == 0 and lm.batcher.stats.submitted == 0
    torch.testing.assert_close(row, lm.next_token_logprobs_sync([3, 4]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="empty"):
        lm.next_token_logprobs_uncached([])
    with pytest.raises(ValueError, match="no LoRA adapters"):
        asyncio.run(lm.next_token_logprobs([3], lora_name="a"))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lm.next_token_logprobs_sync([3], lora_name="a")


async def test_reset_async_queries_fails_queued_requests_and_keeps_serving(lm):
    queued = [asyncio.ensure_future(lm.next_token_logprobs([i])) for i in range(2)]  # under batch_size=4
    await asyncio.sleep(0.01)
    lm.reset_async_queries()
    for q in queued:
        with pytest.raises(BatcherError, match="reset_async_queries"):
            await q
    assert lm.calls == []  # nothing ran
    rows = await asyncio.gather(*(lm.next_token_logprobs([i]) for i in range(4)))  # a full batch flushes
    alone = lm.next_token_logprobs_uncached([2])
    # the same exact logits, normalised in a batch of 4 and alone: two float32 log_softmax computations
    tol = bounds.log_softmax_difference(lm.vocab_size, float(alone.min()))
    bounds.within("seed api: batched vs uncached row", bounds.row_difference(rows[2], alone), tol)


def test_reset_after_an_aborted_run_forgets_the_queue(lm):
    async def aborted():
        left = asyncio.ensure_future(lm.next_token_logprobs([1]))
        await asyncio.sleep(0)
        assert not left.done()
        raise RuntimeError("the program failed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        asyncio.run(aborted())
    lm.reset_async_queries()
    assert not lm.batcher._pending

    async def a_full_batch():  # batch_size requests: flushed at once, not after the fixture's 10 s timeout
        return await asyncio.gather(*(lm.next_token_logprobs([t]) for t in (2, 3, 4, 5)))

    rows = asyncio.run(asyncio.wait_for(a_full_batch(), 20))
    assert [row.shape for row in rows] == [(lm.vocab_size,)] * 4


def test_clear_kv_cache_keeps_outputs(lm):
    lm.next_token_logprobs_sync([5])
    dropped = []
    lm.clear_backend_cache = lambda: dropped.append(True)
    lm.clear_kv_cache()
    assert dropped == [True] and len(lm.cache) == 1


async def test_cleanup_may_be_awaited_or_not(lm, toy_tok):
    vocab, _ = decode_vocab(toy_tok)
    char, byte = AsyncTokenCharacterTrie.from_vocab(vocab), AsyncTokenByteTrie.from_vocab(vocab)
    assert isinstance(char.cleanup(), Closed) and char.closed
    await byte.cleanup()
    await byte.cleanup()  # twice is harmless
    assert byte.closed
    await lm.cleanup()
    with pytest.raises(ClosedError):
        lm.next_token_logprobs_sync([1])
    assert not inspect.iscoroutinefunction(lm.cleanup)  # no "never awaited" warning when not awaited


def test_byte_trie_takes_genlm_bytes_arguments(toy_tok):
    vocab, _ = decode_vocab(toy_tok)
    eos = bytes(vocab[toy_tok.eos_token_id])
    ours = TokenByteTrie(vocab, eos_byte_strings=[eos], atomic_byte_strings=[b"th"])
    seed = TokenByteTrie(vocab, "cpu", [b"th"], None, [eos], 2)  # positionally, in genlm-bytes' order
    old = TokenByteTrie(vocab, atomic_tokens=[b"th"], eos_tokens=[eos], eot_token=None)
    torch_engine = TokenByteTrie(vocab, device="cpu", engine="torch", eos_byte_strings=[eos])
    ws = np.random.default_rng(0).random((5, len(vocab)))
    for mode in (None, TrieMode.WITH_EOS):
        want = ours.batch_weight_sum(ws, mode)
        assert want.shape == (5, ours.num_nodes)
        # exact: the same trie built from the same arguments, spelled three ways, sums the same way
        np.testing.assert_array_equal(seed.batch_weight_sum(ws, mode), want)
        np.testing.assert_array_equal(old.batch_weight_sum(ws, mode), want)
    eos_mass = ours.batch_weight_sum(ws, TrieMode.WITH_EOS)[:, ours.eos_node]
    np.testing.assert_array_equal(eos_mass, ws[:, toy_tok.eos_token_id])  # one EOS token: no addition
    assert (ours.batch_weight_sum(ws)[:, ours.eos_node] == 0).all()
    numba_engine = TokenByteTrie(vocab, eos_byte_strings=[eos])
    want = numba_engine.weight_sum(ws[0])
    index = numba_engine.trie.index
    tol = np.append(2 * bounds.tree_sum_error(index.parent, index.depth, want[:-1]), 0.0)  # EOS: same numpy sum
    bounds.within_each(
        "seed api: torch vs numba byte trie",
        torch_engine.weight_sum(ws[0]),
        want,
        tol,
        "two float64 trie sums in any order: 2 x tree_sum_error",
    )
    with pytest.raises(TypeError, match="not both"):
        TokenByteTrie(vocab, eos_byte_strings=[eos], eos_tokens=[eos])
    with pytest.raises(ValueError, match="eot_sentinel"):
        TokenByteTrie(vocab, eot_sentinel=b"<eot>")


async def test_byte_trie_weight_max_matches_brute_force(toy_tok):
    vocab, _ = decode_vocab(toy_tok)
    trie = AsyncTokenByteTrie.from_vocab(vocab)
    logs = np.log(np.random.default_rng(1).random(len(vocab)))
    got = await trie.weight_max(logs)
    assert got.shape == (trie.trie.num_nodes,) and got[trie.trie.eos_node] == -np.inf
    for prefix in (b"", b"t", b"th", b"a"):
        node = trie.trie.node_of(prefix)
        want = max(w for t, w in zip(vocab, logs) if bytes(t).startswith(prefix))
        assert got[node] == want
    trie.close()


def test_beam_params_follow_genlm_bytes():
    """Field order and defaults of genlm-bytes: the EOS tokens kept as a set (None: the empty set, no EOS)."""
    p = BeamParams(5, 0.1, True, [b"<eos>", b"<eos>"])
    assert (p.K, p.prune_threshold, p.verbose, p.eos_byte_strings) == (5, 0.1, True, {b"<eos>"})
    assert BeamParams(3).eos_byte_strings == set() and BeamParams(3).heal
    with pytest.warns(DeprecationWarning, match="eos_tokens.*deprecated"):
        old = BeamParams(3, eos_tokens=[b"<eos>"])
    assert old.eos_byte_strings == {b"<eos>"} and old.eos_tokens is None
    with pytest.raises(TypeError, match="Cannot specify both"):
        BeamParams(3, eos_byte_strings=[b"a"], eos_tokens=[b"b"])
    # A Token is its bytes plus an id: beside the same bytes listed plainly (every token with them) it
    # adds nothing; alone, it keeps its id; ids stay ids.
    eos = Token(7, b"a")
    assert BeamParams(3, eos_byte_strings=[eos, b"a", 9]).eos_byte_strings == {b"a", 9}
    kept = BeamParams(3, eos_byte_strings=[eos]).eos_byte_strings
    assert kept == {eos} and next(iter(kept)).token_id == 7
