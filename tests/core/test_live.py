"""Core's live sequences (genlm_core.live) on the template plugin's toy recurrent engine: the shared
randomised particle check, and each rule (continue, fork, copy, fresh, evict, no room, failure) alone,
every row against the engine's uncached row."""

from __future__ import annotations

import pytest
import torch

from genlm_core import Failed, Request
from genlm_core.live import LiveEngine, LiveSequences, NoRoom
from genlm_core.testing.live import check_live_sequences
from genlm_core.testing.tokenizers import toy_tokenizer

recurrent = pytest.importorskip("genlm_example.recurrent", reason="pip install -e examples/plugin_template")


def toy(**options):
    return recurrent.RecurrentLM(toy_tokenizer(), timeout=0.001, **options)


def uncached(lm, ids):
    return lm.next_token_logprobs_uncached(list(ids))


def rows(lm, contexts):
    return lm.batch_next_token_logprobs_sync(contexts)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"live": {"lookback": 3}},
        {"batch_size": 4, "sequences": 9},  # steps split into batches; sequence ids run out: evictions
        {"batch_size": 6, "positions": 150},  # the engine's room runs out: evictions, batches computed alone
        {"live": {"max_idle_batches": 1, "max_sequences": 8}},
    ],
)
def test_the_shared_particle_check_passes_on_the_toy_engine(options):
    lm = toy(**options)
    stats = check_live_sequences(lm, lm.sequences, in_use=lambda: len(lm.states.held), steps=50)
    if "sequences" in options or "positions" in options:
        assert stats.evicted > 0
    else:
        assert stats.tokens_computed < 2 * stats.rows  # most rows computed one token
    if "positions" in options:
        assert stats.alone > 0
    if "batch_size" in options or "lookback" in options.get("live", {}):
        assert stats.copied > 0  # a sibling in a later batch, or a particle that went back
    lm.cleanup()


def test_the_check_fails_when_a_sequence_holds_other_tokens_than_recorded(monkeypatch):
    """The check can fail: an engine whose copy takes one position too few gives wrong rows."""
    lm = toy()
    real = lm.states.copy

    def off_by_one(source, target, length):
        real(source, target, length)
        lm.states.held[target] = lm.states.held[target][:-1] + [lm.states.held[target][-1] * 0.5]
        return True

    monkeypatch.setattr(lm.states, "copy", off_by_one)
    with pytest.raises(AssertionError, match="from the uncached row"):
        check_live_sequences(lm, lm.sequences, in_use=lambda: len(lm.states.held), steps=20)


def test_each_placement_rule_and_its_counters():
    lm = toy(batch_size=8)
    s = lm.sequences.stats
    a, b = (5, 6, 7), (9, 10)
    served = dict(zip([a, b], rows(lm, [a, b])))
    assert (s.fresh, s.tokens_computed) == (2, 5)
    # a continues; two children of b: one continues b, the other forks it
    step = [(*a, 1), (*b, 2), (*b, 3)]
    served.update(zip(step, rows(lm, step)))
    assert (s.continued, s.forked, s.tokens_computed, s.tokens_copied) == (2, 1, 8, 2)
    # a sibling of (*a, 1) in a later batch copies what the sequence that moved past (a) holds
    served[(*a, 4)] = rows(lm, [(*a, 4)])[0]
    assert (s.copied, s.tokens_computed, s.tokens_copied) == (1, 9, 5)
    # a particle goes back two tokens: the longest prefix held anywhere is copied
    served[(5, 6, 8)] = rows(lm, [(5, 6, 8)])[0]
    assert s.copied == 2
    # the same context as a live one, past the output cache: its prefix is copied, one token computed
    lm.cache.clear()
    served[(9, 10, 2)] = rows(lm, [(9, 10, 2)])[0]
    assert s.copied == 3 and s.rows == s.continued + s.forked + s.copied + s.fresh == 8
    for context, row in served.items():
        assert torch.allclose(row, uncached(lm, context), atol=1e-5)


def test_a_sequence_nobody_continues_stays_live_until_evicted_oldest_first():
    lm = toy(batch_size=2, sequences=3)
    rows(lm, [(1, 2), (3, 4)])
    rows(lm, [(5, 6)])  # three live: (1, 2) is the oldest
    s = lm.sequences.stats
    row = rows(lm, [(3, 4, 1), (7, 8)])  # continues (3, 4); (7, 8) needs an id: (1, 2) goes
    assert (s.continued, s.evicted) == (1, 1)
    assert torch.allclose(row[1], uncached(lm, (7, 8)), atol=1e-5)
    row = rows(lm, [(1, 2, 3)])  # (1, 2) was evicted: computed fresh, never from a stale sequence
    assert s.continued == 1 and torch.allclose(row[0], uncached(lm, (1, 2, 3)), atol=1e-5)


def test_max_idle_batches_lets_unclaimed_sequences_go():
    lm = toy(live={"max_idle_batches": 1})
    rows(lm, [(1, 2)])
    rows(lm, [(8,)])
    rows(lm, [(9,)])  # (1, 2) idle for two batches: released
    assert len(lm.sequences) == 2 and len(lm.states.held) == 2
    rows(lm, [(1, 2, 3)])
    assert lm.sequences.stats.continued == 0


def test_live_off_computes_every_row_whole_and_keeps_nothing():
    lm = toy(live={"enabled": False})
    contexts = [(1, 2, 3), (1, 2, 3, 4), (5,)]
    got = rows(lm, contexts)
    got2 = rows(lm, [(1, 2, 3, 4, 5)])
    s = lm.sequences.stats
    assert (s.continued, s.fresh, s.tokens_computed) == (0, 4, 13) and not lm.states.held
    for context, row in zip([*contexts, (1, 2, 3, 4, 5)], [*got, *got2]):
        assert torch.allclose(row, uncached(lm, context), atol=1e-5)


def test_a_batch_that_does_not_fit_is_computed_one_request_at_a_time():
    lm = toy(batch_size=4, positions=12)
    contexts = [tuple(range(10 * i + 1, 10 * i + 7)) for i in range(4)]  # 24 states: never at once
    got = rows(lm, contexts)
    assert lm.sequences.stats.alone == 4
    for context, row in zip(contexts, got):
        assert torch.allclose(row, uncached(lm, context), atol=1e-5)
    with pytest.raises(NoRoom):  # one request alone does not fit either: a clear error
        rows(lm, [tuple(range(1, 14))])
    assert sum(map(len, lm.states.held.values())) <= 12


class Failing(LiveEngine[int, torch.Tensor]):
    """Wraps the toy's engine: fails the run of any batch holding token 13, or the row of token 66 alone."""

    def __init__(self, inner):
        self.inner = inner

    def take(self):
        return self.inner.take()

    def release(self, seqs):
        self.inner.release(seqs)

    def copy(self, source, target, length):
        return self.inner.copy(source, target, length)

    def run(self, pieces, make_room):
        if any(13 in p.new_tokens for p in pieces):
            raise RuntimeError("engine error")
        ran = self.inner.run(pieces, make_room)
        ran.failed = {p.index: ValueError("row failed") for p in pieces if 66 in p.new_tokens}
        return ran


def test_a_failed_batch_or_row_leaves_no_sequence_of_it_live_and_serving_goes_on():
    lm = toy(batch_size=4)
    lm.sequences = LiveSequences(Failing(lm.states), lm.options.live)
    rows(lm, [(1, 2), (3, 4)])
    with pytest.raises(RuntimeError, match="engine error"):
        rows(lm, [(1, 2, 5), (3, 4, 13)])
    assert len(lm.sequences) == 0 and not lm.states.held  # both continued sequences are gone
    out = lm.compute_rows([Request((7, 8)), Request((9, 66))])
    assert isinstance(out[1], Failed) and torch.allclose(out[0], uncached(lm, (7, 8)), atol=1e-5)
    assert set(map(len, lm.states.held.values())) == {2}  # only (7, 8) stays live
    got = rows(lm, [(1, 2, 5), (7, 8, 1)])
    assert lm.sequences.stats.continued == 1
    assert torch.allclose(got[0], uncached(lm, (1, 2, 5)), atol=1e-5)
    assert torch.allclose(got[1], uncached(lm, (7, 8, 1)), atol=1e-5)
