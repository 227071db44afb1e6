"""The byte beam's prefetch on its own: the rows it requests against the brute-force lattice of the
coming bytes and against what the beam really asks for, and the masses it hands back against rows
computed uncached."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from genlm_core.bytes import BeamParams, ByteBeamState, TrieMode
from genlm_core.bytes.prefetch import Bound, drop_surely_pruned, prefetch, surely_kept
from genlm_core.mock import MockAsyncLM
from genlm_core.testing import bounds
from genlm_core.testing.tokenizers import toy_tokenizer

from .exact import lattice

TEXT = b"the abc the ab cab th"


@pytest.fixture(scope="module")
def lm():
    return MockAsyncLM(toy_tokenizer(), scale=1.5, batch_size=64, timeout=0.001)


class Recorder:
    """Stands in for ``next_token_logprobs``: records each context asked for, then has ``compute`` (the
    model's own method) compute it, or computes nothing."""

    def __init__(self, compute=None):
        self.asked: list[tuple[int, ...]] = []
        self.compute = compute

    async def __call__(self, context):
        self.asked.append(tuple(context))
        return None if self.compute is None else await self.compute(context)


async def beams(lm, K, text=TEXT):
    """``(pruned beam, the bytes from here on)`` at each byte of a prefill of ``text`` without lookahead."""
    lm.clear_cache()
    params = BeamParams(K=K, heal=False, eos_byte_strings=[lm.tokenizer.eos_token_id])  # text meanwhile
    beam = await ByteBeamState.initial(lm, params)
    beam = await beam.with_mode(TrieMode.WITHOUT_EOS)._materialized()
    for i, b in enumerate(text):
        beam = beam.prune()
        yield beam, text[i:]
        beam = await (beam << b)
    beam.cleanup()


async def requested(lm, monkeypatch, states, K, upcoming, budget=None):
    """The contexts a prefetch requests (each once, in order) and the masses it hands back."""
    recorder = Recorder()
    with monkeypatch.context() as patch:
        patch.setattr(lm, "next_token_logprobs", recorder)
        started = prefetch(states, K, upcoming, budget)
        for request in started.requests:
            await request
    assert len(recorder.asked) == len(set(recorder.asked))
    return set(recorder.asked), {tuple(context): m for context, m in started.masses.items()}  # handles as tuples


async def warm_half(lm, contexts):
    """Compute the rows of every other context (in sorted order), so that they are cached."""
    await asyncio.gather(*(lm.next_token_logprobs(list(c)) for c in sorted(contexts)[::2]))


def uncached(lm, contexts):
    return {c for c in contexts if lm.cached_logprobs(c) is None}


@pytest.mark.parametrize("lookahead", [2, 4])
async def test_without_pruning_it_requests_the_uncached_lattice_and_hands_back_the_cached_masses(
    lm, monkeypatch, lookahead
):
    """A beam too wide to prune, with every other context the coming bytes could need (brute force)
    computed beforehand: the others are requested whenever the first byte needs a new row, nothing
    otherwise. The masses handed back are those of the cached contexts, equal to masses of rows
    computed uncached."""
    checked, reference = 0, {}
    async for beam, rest in beams(lm, K=10_000):
        trie, upcoming = beam.states[0].trie.trie, rest[:lookahead]
        possible = lattice(beam.states, upcoming)
        await warm_half(lm, possible)
        asked, masses = await requested(lm, monkeypatch, beam.states, 10_000, upcoming)
        first_needs_a_row = bool(uncached(lm, lattice(beam.states, upcoming[:1])))
        assert asked == (uncached(lm, possible) if first_needs_a_row else set())
        if first_needs_a_row:
            assert set(masses) == possible - asked
        for context, m in masses.items():
            if context not in reference:
                row = lm.next_token_logprobs_uncached(list(context))
                # the cached row was normalised in a batch, this one alone: two float32 log_softmaxes of the
                # mock's logits, whose exponentials (the same float64 exp) differ by expm1 of that, relative
                delta = bounds.log_softmax_difference(lm.vocab_size, float(row.min()))
                reference[context] = (trie.masses(row, TrieMode.WITHOUT_EOS, log=True).leaf_probs, delta)
            want, delta = reference[context]
            bounds.within_each(
                "prefetch: cached masses vs uncached", m.leaf_probs, want, math.expm1(delta) * want, delta.basis
            )
        checked += bool(asked) and bool(masses)
    assert checked >= 3


@pytest.mark.parametrize("K", [1, 2, 3])
async def test_it_requests_every_row_the_pruned_beam_then_asks_for_and_fewer_than_the_lattice(lm, monkeypatch, K):
    """From each byte of a prefill (cache emptied first), the beam stepped without prefetch over the
    next bytes asks only for rows the prefetch requested or found cached; the prefetch requests only
    lattice contexts, and leaves out some that the pruned beam can no longer reach."""
    upcoming_len, requested_total, possible_total = 4, 0, 0
    async for beam, rest in beams(lm, K):
        upcoming = rest[:upcoming_len]
        lm.clear_cache()  # the beam's states keep their masses: the first byte needs new rows again
        possible = lattice(beam.states, upcoming)
        asked, masses = await requested(lm, monkeypatch, beam.states, K, upcoming)
        if not asked:
            continue
        assert asked <= possible and set(masses).isdisjoint(asked)
        real = Recorder(lm.next_token_logprobs)
        with monkeypatch.context() as patch:
            patch.setattr(lm, "next_token_logprobs", real)
            stepped = beam
            for b in upcoming:
                stepped = await (stepped.prune() << b)
        assert set(real.asked) <= asked | set(masses)
        requested_total, possible_total = requested_total + len(asked), possible_total + len(possible)
    assert 0 < requested_total < possible_total


@pytest.mark.parametrize("budget", [0, 2, 5])
async def test_budget_stops_after_the_byte_that_exceeds_it(lm, monkeypatch, budget):
    """A beam too wide to prune: the requests are the uncached lattice of the coming bytes up to the
    first byte at which more than ``budget`` of them are wanted (all of them if none is)."""
    checked = 0
    async for beam, rest in beams(lm, K=10_000):
        upcoming = rest[:5]
        wanted = [uncached(lm, lattice(beam.states, upcoming[: d + 1])) for d in range(len(upcoming))]
        asked, _ = await requested(lm, monkeypatch, beam.states, 10_000, upcoming, budget)
        if not wanted[0]:
            assert asked == set()
            continue
        assert asked == next((w for w in wanted if len(w) > budget), wanted[-1])
        checked += asked != wanted[-1]
    assert checked >= 3


async def test_it_reads_rows_through_cached_logprobs(lm, monkeypatch):
    """Every other lattice context computed, but an LM whose cache lookup finds nothing: once the first
    byte commits a token, every lattice context is requested, and no masses come back."""
    checked = 0
    async for beam, rest in beams(lm, K=10_000):
        await warm_half(lm, lattice(beam.states, rest[:3]))
        with monkeypatch.context() as patch:
            patch.setattr(lm, "cached_logprobs", lambda token_ids, lora_name=None: None)
            asked, masses = await requested(lm, monkeypatch, beam.states, 10_000, rest[:3])
        commits_now = bool(lattice(beam.states, rest[:1]))
        assert masses == {} and asked == (lattice(beam.states, rest[:3]) if commits_now else set())
        checked += commits_now
    assert checked >= 3


def ahead(h, others, ties_against_h):
    """How many of ``others`` come before ``h`` in a pruned beam, as they weigh what they say."""
    return sum(g.weight > h.weight or (ties_against_h and g.weight == h.weight) for g in others)


@pytest.mark.parametrize("seed", range(20))
def test_surely_kept_and_surely_pruned_are_the_worst_and_best_cases(seed):
    """A hypothesis is surely kept when it stays in the realization worst for it (every other
    hypothesis exists at its bound, ties go against it), and surely pruned when it goes in the one
    best for it (only the hypotheses that surely exist are there, ties go its way)."""
    rng = np.random.default_rng(seed)
    K = int(rng.integers(1, 5))
    frontier = [
        Bound(None, 0, float(w), None, bool(sure)) for w, sure in zip(rng.integers(-6, 0, 12), rng.random(12) < 0.6)
    ]
    others = [[g for g in frontier if g is not h] for h in frontier]
    kept = [h.sure and ahead(h, rest, True) < K for h, rest in zip(frontier, others)]
    pruned = [ahead(h, [g for g in rest if g.sure], False) >= K for h, rest in zip(frontier, others)]
    assert surely_kept(frontier, K) == kept
    assert drop_surely_pruned(frontier, K) == [h for h, out in zip(frontier, pruned) if not out]


async def test_an_empty_beam_requests_nothing(lm):
    assert prefetch([], 5, b"abc") == ([], {})
