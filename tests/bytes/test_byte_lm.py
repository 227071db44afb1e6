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
from genlm_core.testing import bounds
from genlm_core.testing.tokenizers import toy_tokenizer

from .exact import Enumerator, beam_float64_error, lattice


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
        want_z = await exact.prefix_logmass(context, text)
        bounds.within("byte lm: log Z vs enumeration", abs(after.logZ - want_z), exact.tolerance(len(text)))
        got = (await after.logp_next()).ps
        want = await exact.next_byte(context, text, eos)
        assert exact.same_rows()
        tol = exact.tolerance(len(text), next_byte=True)
        bounds.within_each("byte lm: next byte vs enumeration", got, want, tol, tol.basis)
        beam.cleanup()

    asyncio.run(main())


def test_prefill_lookahead_is_the_same_beam_and_packed_rows_run_shared_tokens_once(tiny_lm, monkeypatch):
    text = b"abc the ab th the abc"

    async def prefill(lookahead):
        tiny_lm.clear_cache()
        before = tiny_lm.tokens_computed
        beam = await ByteBeamState.initial(tiny_lm, BeamParams(K=5, heal=False))
        start = len(beam.states[0].lm_state.context)
        after = await beam.prefill(text, lookahead)
        kept = sorted((tuple(s.lm_state.context), s.node) for s in after.states)
        return after.logZ, tiny_lm.tokens_computed - before, (start, kept)

    def tolerance(z, start_kept):
        """Other lookaheads batch (or pack) the rows otherwise: float32 rows of the same model that differ by
        at most ``delta`` (:func:`bounds.model_difference` of the float32 pass's own error on these contexts),
        which moves each row's log-mass ratios by at most ``2 delta``; a hypothesis reads one row per token
        it committed, plus one. The same hypotheses survive pruning (checked), and the beam's own float64
        rounding counts twice."""
        from genlm_core.testing.models import tiny_model_dir

        start, kept = start_kept
        read = sorted({c[:k] for c, _ in kept for k in range(start, len(c) + 1)})  # every row a survivor read
        delta = bounds.model_difference(bounds.float32_error(str(tiny_model_dir("llama", tokenizer="toy")), read))
        rows = max(len(c) for c, _ in kept) - start + 1
        f64 = beam_float64_error(tiny_lm.vocab_size, 2 * (len(text) + 1), 2 * abs(z) + math.log(tiny_lm.vocab_size), 5)
        return bounds.Bound(2 * rows * float(delta) + 2 * f64, f"2 x {rows} rows x ({delta.basis}) + 2 x float64 beam")

    async def main():
        z1, _, kept1 = await prefill(1)
        tol = tolerance(z1, kept1)
        for lookahead in (2, 3, 5, None):
            z, _, kept = await prefill(lookahead)
            assert kept == kept1
            bounds.within("byte lm: prefill lookahead, tiny model", abs(z - z1), tol, f"lookahead {lookahead}")
        _, packed, _ = await prefill(5)
        monkeypatch.setattr(tiny_lm, "packs_shared_tokens", False)
        z_unpacked, unpacked, kept = await prefill(5)
        assert kept == kept1 and packed < unpacked
        bounds.within("byte lm: packed vs unpacked rows, tiny model", abs(z_unpacked - z1), tol)

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
        # exact: the mock's rows are a function of the context alone, normalised row by row (the same
        # kernel, whatever the batch), and the beam runs the same float64 operations on them: the lookahead
        # changes only when rows are computed
        assert z == z1
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
        assert z == z1  # exact, as in the test above
        assert len(rows) > 10 and len(rows) == len(set(rows))

    asyncio.run(main())


def test_prefill_equals_stepping_bytes_one_by_one(mock_lm):
    async def main():
        beam = await ByteBeamState.initial(mock_lm, BeamParams(K=3))
        prefilled = await beam.prefill(b"the abc")
        stepped = beam
        for b in b"the abc":  # no EOS bytes in this text: both modes agree
            stepped = await (stepped.prune() << b)
        # exact: the same rows (the mock's, cached) and the same float64 operations, byte by byte
        assert prefilled.logZ == stepped.logZ
        np.testing.assert_array_equal((await prefilled.logp_next()).ps, (await stepped.logp_next()).ps)
        beam.cleanup()

    asyncio.run(main())


def test_eos_probability_is_logsumexp_of_eos_tokens(mock_lm):
    async def main():
        eos_ids = [0, 100]  # "<eos>" and the byte "c"
        params = BeamParams(K=5, eos_byte_strings=[mock_lm.byte_vocab[0], 100])  # a Token and an id
        beam = await ByteBeamState.initial(mock_lm, params)
        logprobs = await mock_lm.next_token_logprobs(beam.states[0].lm_state.context)
        q = await beam.logp_next()
        # the beam renormalises the row in float64; the float32 row sums to 1 up to normalisation_error,
        # and the beam's float64 steps (one row, a log-sum-exp over 258) add beam_float64_error
        want = torch.logsumexp(logprobs[eos_ids].double(), 0).item()
        tol = float(bounds.normalisation_error(mock_lm.vocab_size)) + 2 * beam_float64_error(
            mock_lm.vocab_size, 4, 2 * abs(want) + math.log(mock_lm.vocab_size), 258
        )
        bounds.within("byte lm: EOS = logsumexp of EOS tokens", abs(q[EOS] - want), tol)
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
    assert eos_with == ws[0] and eos_without == 0  # one EOS token: no addition, exact
    lt = trie.node_of(b"<")
    # its mass left the byte path: two float64 trie sums of "<" (tree_sum_error each) and the subtraction
    index = trie.trie.index
    tol = 2 * bounds.tree_sum_error(index.parent, index.depth, without[: trie.eos_node])[lt] + bounds.U64 * ws[0]
    bounds.within("byte trie: EOS mass leaves its byte path", abs(without[lt] - with_eos[lt] - ws[0]), tol)
    assert with_eos[trie.root] == without[trie.root]  # exact: the same numpy sum of the same row
    # the root sums every token (numpy, pairwise) against another order of the same sum
    tol = 2 * bounds.sum_error(len(ws), float(ws.sum()), bounds.U64)
    bounds.within("byte trie: root = every token's mass", abs(with_eos[trie.root] - ws.sum()), tol)
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
        want_z = await exact.prefix_logmass(context, b" the")
        bounds.within("byte lm: duplicate tokens, log Z", abs(after.logZ - want_z), exact.tolerance(4))
        got, want = (await after.logp_next()).ps, await exact.next_byte(context, b" the", eos)
        assert exact.same_rows()
        tol = exact.tolerance(4, next_byte=True)
        bounds.within_each("byte lm: duplicate tokens, next byte", got, want, tol, tol.basis)
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
    assert q[ord("a")] == math.log(0.75) and q[None] == -np.inf and q.argmax() == ord("a")  # stored as given
    chart = q.materialize().map_values(math.exp)
    # exp(fl(log p)): the log's rounding (u |log p| < u) and exp's own (FN_ULPS_U u), relative
    rel = (bounds.FN_ULPS_U + 1) * bounds.U64
    assert chart[ord("a")] == pytest.approx(0.75, rel=rel, abs=0) and chart[EOS] == pytest.approx(0.25, rel=rel, abs=0)
    assert q.pretty().map_values(math.exp).trim() == pytest.approx({"a": 0.75, "EOS": 0.25}, rel=rel, abs=0)
    assert Chart(0, {"x": 1}) + Chart(0, {"x": 2, "y": 1}) == {"x": 3, "y": 1}
    with pytest.raises(ValueError):
        LazyByteProbs(np.zeros(10))


def test_async_byte_trie_batches(mock_lm):
    trie = AsyncTokenByteTrie.from_vocab(mock_lm.byte_vocab, eos_token_ids=[0], batch_size=8)
    rows = [np.exp(mock_lm.next_token_logprobs_sync([i]).double().numpy()) for i in range(1, 6)]

    async def main():
        return await asyncio.gather(*(trie.weight_sum(w, TrieMode.WITH_EOS) for w in rows))

    out = asyncio.run(main())
    for w, masses in zip(rows, out):  # exact: each row of a batch is summed as it is alone
        np.testing.assert_array_equal(masses, trie.trie.weight_sum(w, TrieMode.WITH_EOS))
        assert masses[trie.trie.eos_node] == w[0] and w[0] > 0  # one EOS token: exact
    assert trie.batcher.stats.batches == 1
    trie.cleanup()


def test_beam_params_validation():
    with pytest.raises(ValueError, match="K"):
        BeamParams(K=0)
    with pytest.raises(ValueError, match="prune_threshold"):
        BeamParams(K=1, prune_threshold=1.5)
