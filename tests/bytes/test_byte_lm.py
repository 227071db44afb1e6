"""The byte-level LM against exact marginalisation over all tokenizations (brute force)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from genlm_core import AsyncLM, Token
from genlm_core.bytes import (
    EOS,
    AsyncTokenByteTrie,
    BeamParams,
    ByteBeamState,
    Chart,
    LazyByteProbs,
    StatefulTokenizedLM,
    TokenByteTrie,
    TrieMode,
)
from genlm_core.mock import MockAsyncLM
from genlm_core.testing.tokenizers import toy_tokenizer

from .exact import Enumerator, lattice


def wide(lm):
    """A beam wide enough to be exact, ending text at the tokenizer's EOS."""
    return BeamParams(K=10_000, heal=False, eos_byte_strings=[lm.tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def mock_lm():
    return MockAsyncLM(toy_tokenizer(), scale=1.5, batch_size=64, timeout=0.001)


@pytest.fixture(scope="module")
def tiny_lm():
    from genlm_core.testing.models import tiny_model_dir
    from genlm_hf import AsyncTransformer

    return AsyncTransformer.from_name(str(tiny_model_dir("llama", tokenizer="toy")), batch_size=64, timeout=0.001)


@pytest.mark.parametrize("which", ["mock_lm", "tiny_lm"])
@pytest.mark.parametrize("text", [b" the ab", b"abc the", b"th"])
def test_wide_beam_equals_exact_marginalisation(request, which, text):
    lm = request.getfixturevalue(which)
    eos = {lm.tokenizer.eos_token_id}

    async def main():
        beam = await ByteBeamState.initial(lm, wide(lm))
        context = beam.states[0].lm_state.context
        after = await beam.prefill(text)
        exact = Enumerator(lm)
        assert after.logZ == pytest.approx(await exact.prefix_logmass(context, text), abs=1e-6)
        got = (await after.logp_next()).ps
        want = await exact.next_byte(context, text, eos)
        np.testing.assert_allclose(got, want, atol=1e-6)
        beam.cleanup()

    asyncio.run(main())


def test_prefill_lookahead_is_the_same_beam_and_packed_rows_run_shared_tokens_once(tiny_lm, monkeypatch):
    text = b"abc the ab th the abc"

    async def prefill(lookahead):
        tiny_lm.clear_cache()
        before = tiny_lm.tokens_computed
        beam = await ByteBeamState.initial(tiny_lm, BeamParams(K=5, heal=False))
        after = await beam.prefill(text, lookahead)
        return after.logZ, tiny_lm.tokens_computed - before

    async def main():
        z1, _ = await prefill(1)
        for lookahead in (2, 3, 5, None):
            assert (await prefill(lookahead))[0] == pytest.approx(z1, abs=1e-5)
        _, packed = await prefill(5)
        monkeypatch.setattr(tiny_lm, "packs_shared_tokens", False)
        z_unpacked, unpacked = await prefill(5)
        assert z_unpacked == pytest.approx(z1, abs=1e-5) and packed < unpacked

    asyncio.run(main())


def test_prefill_speculates_only_what_the_beam_could_still_need(mock_lm, monkeypatch):
    """Each speculative batch of a prefill is inside the lattice of the coming bytes (everything
    the beam could ask for, pruning aside) and smaller than it: hypotheses surely pruned by then
    are left out. The result is that of prefill without lookahead."""
    import genlm_core.bytes.beam as beam_module

    monkeypatch.setattr(beam_module, "PREFETCH_BUDGET", None)
    text, lookahead = b"the abc the ab cab", 4
    own, seen, rounds = mock_lm.next_token_logprobs, set(), []
    prefetch = beam_module.prefetch

    def ask(context):
        seen.add(tuple(context))
        return own(context)

    def spied(states, K, upcoming, budget=None):
        uncached = {c for c in lattice(states, upcoming) if mock_lm.cached_logprobs(c) is None}
        before = set(seen)
        started = prefetch(states, K, upcoming, budget)
        if started.requests:
            rounds.append((seen - before, uncached))
        return started

    async def prefill(lookahead):
        mock_lm.clear_cache()
        beam = await ByteBeamState.initial(mock_lm, BeamParams(K=2, heal=False))
        return (await beam.prefill(text, lookahead)).logZ

    async def main():
        z1 = await prefill(1)
        monkeypatch.setattr(beam_module, "prefetch", spied)
        mock_lm.next_token_logprobs = ask
        try:
            z = await prefill(lookahead)
        finally:
            del mock_lm.next_token_logprobs  # the class's method again
        assert z == pytest.approx(z1, abs=1e-9)
        assert rounds and all(asked <= possible for asked, possible in rounds)
        assert sum(len(asked) for asked, _ in rounds) < sum(len(possible) for _, possible in rounds)

    asyncio.run(main())


def test_prefill_sums_each_row_over_the_trie_once(mock_lm, monkeypatch):
    """A row's trie masses, computed when the speculation looked at it, are reused when the beam
    takes the same context: one trie sum per distinct row, and the same log Z."""
    from genlm_core.bytes.trie import TokenByteTrie

    rows: list[tuple[bytes, TrieMode]] = []  # each trie sum's row and mode (the beam ends WITH_EOS)
    own = TokenByteTrie.masses

    def counted(trie, probs, mode=TrieMode.WITHOUT_EOS, *, log=False):
        rows.append((np.asarray(probs).tobytes(), mode))
        return own(trie, probs, mode, log=log)

    async def prefill(lookahead):
        mock_lm.clear_cache()
        beam = await ByteBeamState.initial(mock_lm, BeamParams(K=2, heal=False))
        return (await beam.prefill(b"the abc the ab cab", lookahead)).logZ

    async def main():
        z1 = await prefill(1)
        monkeypatch.setattr(TokenByteTrie, "masses", counted)
        z = await prefill(4)
        assert z == pytest.approx(z1, abs=1e-9)
        assert len(rows) > 10 and len(rows) == len(set(rows))

    asyncio.run(main())


def test_prefill_equals_stepping_bytes_one_by_one(mock_lm):
    async def main():
        beam = await ByteBeamState.initial(mock_lm, BeamParams(K=3))
        prefilled = await beam.prefill(b"the abc")
        stepped = beam
        for b in b"the abc":  # no EOS bytes in this text: both modes agree
            stepped = await (stepped.prune() << b)
        assert prefilled.logZ == pytest.approx(stepped.logZ, abs=1e-9)
        np.testing.assert_allclose((await prefilled.logp_next()).ps, (await stepped.logp_next()).ps, atol=1e-9)
        beam.cleanup()

    asyncio.run(main())


def test_eos_probability_is_logsumexp_of_eos_tokens(mock_lm):
    async def main():
        eos_ids = [0, 100]  # "<eos>" and the byte "c"
        params = BeamParams(K=5, eos_byte_strings=[mock_lm.byte_vocab[0], 100])  # a Token and an id
        beam = await ByteBeamState.initial(mock_lm, params)
        logprobs = await mock_lm.next_token_logprobs(beam.states[0].lm_state.context)
        q = await beam.logp_next()
        assert q[EOS] == pytest.approx(torch.logsumexp(logprobs[eos_ids].double(), 0).item(), abs=1e-6)
        assert q[ord("c")] == -np.inf  # no other token starts with "c": its mass went to EOS
        beam.cleanup()

    asyncio.run(main())


def test_eos_token_given_as_token_is_not_lost(mock_lm):
    trie = TokenByteTrie(mock_lm.byte_vocab, eos_byte_strings=[Token(0, b"<eos>")])
    assert trie.eos_token_ids == [0]
    ws = np.exp((mock_lm.next_token_logprobs_sync([1])).double().numpy())
    with_eos = trie.weight_sum(ws, TrieMode.WITH_EOS)
    without = trie.weight_sum(ws, TrieMode.WITHOUT_EOS)
    assert with_eos.shape == without.shape == (trie.num_nodes,)
    eos_with, eos_without = with_eos[trie.eos_node], without[trie.eos_node]
    assert eos_with == pytest.approx(ws[0]) and eos_without == 0
    lt = trie.node_of(b"<")
    assert without[lt] - with_eos[lt] == pytest.approx(ws[0])  # its mass left the byte path
    assert with_eos[trie.root] == pytest.approx(ws.sum()) == without[trie.root]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TokenByteTrie(mock_lm.byte_vocab, eos_byte_strings=[b"<nope>"])


def test_duplicate_tokens(mock_lm):
    tok = toy_tokenizer.__wrapped__()
    tok.add_tokens([" the"])  # same bytes as the regular token "Ġthe"
    lm = MockAsyncLM(tok, scale=1.5)
    eos = {tok.eos_token_id}

    async def main():
        beam = await ByteBeamState.initial(lm, wide(lm))
        context = beam.states[0].lm_state.context
        after = await beam.prefill(b" the")
        exact = Enumerator(lm)
        assert after.logZ == pytest.approx(await exact.prefix_logmass(context, b" the"), abs=1e-6)
        np.testing.assert_allclose(
            (await after.logp_next()).ps, await exact.next_byte(context, b" the", eos), atol=1e-6
        )
        committed = {s.lm_state.context[-1] for s in after.states if s.node == s.trie.trie.root}
        assert {tok.convert_tokens_to_ids("Ġthe"), tok.convert_tokens_to_ids(" the")} <= committed | {
            e.lm_state.context[-1] for s in after.states for e in s.extend_all()
        }
        beam.cleanup()

    asyncio.run(main())


class PreferLM(AsyncLM):
    """Puts most mass on one token, whatever the context (to make a narrow beam predictable)."""

    def __init__(self, tokenizer, favourite):
        super().__init__(tokenizer, batch_size=16, timeout=0.001)
        self.favourite = favourite

    def forward_batch(self, requests):
        logits = torch.zeros(len(requests), self.vocab_size)
        logits[:, self.favourite] = 8.0
        return logits


def test_healing_recovers_prompt_ending_mid_token():
    tok = toy_tokenizer()
    lm = PreferLM(tok, tok.convert_tokens_to_ids("Ġthe"))

    async def run(heal):
        beam = await ByteBeamState.initial(lm, BeamParams(K=1, heal=heal))
        beam = await beam.prefill(b" th")  # K=1 keeps " th" inside the favoured " the"
        assert beam.states[0].partial == b" th"
        after = await (beam.prune() << ord("x"))
        if not after.states:
            with pytest.raises(ValueError, match="beam is empty"):
                await after.logp_next()
        beam.cleanup()
        return after

    failed = asyncio.run(run(heal=False))
    assert len(failed) == 0
    healed = asyncio.run(run(heal=True))
    assert len(healed) == 1 and math.isfinite(healed.logZ)
    (state,) = healed.states
    spelled = b"".join(bytes(lm.byte_vocab[i]) for i in state.lm_state.context[1:]) + state.partial
    assert spelled == b" thx"


def test_max_context_length_kept_across_steps(mock_lm):
    state = StatefulTokenizedLM.initial(mock_lm, [1, 2], max_context_length=3)
    for t in range(10):
        state = state << 5 + t
        assert len(state.context) <= 3 and state.max_context_length == 3
    assert state.context == [12, 13, 14]


def test_initial_context_uses_bos_only_where_the_tokenizer_has_one():
    from genlm_core.bytes.lm_state import default_initial_context
    from genlm_core.testing.tokenizers import load_tokenizer

    llama = MockAsyncLM(load_tokenizer("mistral-v1"))
    assert default_initial_context(llama) == [1]  # <s>
    no_bos = toy_tokenizer.__wrapped__()
    no_bos.bos_token = None
    lm = MockAsyncLM(no_bos)
    assert lm.tokenizer.bos_token_id is None
    assert default_initial_context(lm) == [no_bos.eos_token_id]  # never [None]


def test_lazy_byte_probs_and_chart():
    ps = np.full(258, -np.inf)
    ps[ord("a")], ps[EOS] = math.log(0.75), math.log(0.25)
    q = LazyByteProbs(ps)
    assert q[ord("a")] == pytest.approx(math.log(0.75)) and q[None] == -np.inf and q.argmax() == ord("a")
    chart = q.materialize().map_values(math.exp)
    assert chart[ord("a")] == pytest.approx(0.75) and chart[EOS] == pytest.approx(0.25)
    assert q.pretty().map_values(math.exp).trim() == pytest.approx({"a": 0.75, "EOS": 0.25})
    assert Chart(0, {"x": 1}) + Chart(0, {"x": 2, "y": 1}) == {"x": 3, "y": 1}
    with pytest.raises(ValueError):
        LazyByteProbs(np.zeros(10))


def test_async_byte_trie_batches(mock_lm):
    trie = AsyncTokenByteTrie.from_vocab(mock_lm.byte_vocab, eos_token_ids=[0], batch_size=8)
    rows = [np.exp(mock_lm.next_token_logprobs_sync([i]).double().numpy()) for i in range(1, 6)]

    async def main():
        return await asyncio.gather(*(trie.weight_sum(w, TrieMode.WITH_EOS) for w in rows))

    out = asyncio.run(main())
    for w, masses in zip(rows, out):
        np.testing.assert_allclose(masses, trie.trie.weight_sum(w, TrieMode.WITH_EOS), rtol=1e-12)
        assert masses[trie.trie.eos_node] == pytest.approx(w[0]) and w[0] > 0
    assert trie.batcher.stats.batches == 1
    trie.cleanup()


def test_beam_params_validation():
    with pytest.raises(ValueError, match="K"):
        BeamParams(K=0)
    with pytest.raises(ValueError, match="prune_threshold"):
        BeamParams(K=1, prune_threshold=1.5)
