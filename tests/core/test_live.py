"""Core's live sequences (genlm_core.live) on the template plugin's toy recurrent engine: the shared
randomised particle check, and each rule (continue, fork, copy, fresh, evict, no room, failure) alone,
every row against the engine's uncached row."""

from __future__ import annotations

import pytest
import torch

from genlm_core import AsyncLM, Failed, Request
from genlm_core.live import LiveEngine, LiveSequences, NoRoom, Ran
from genlm_core.testing import bounds
from genlm_core.testing import live as live_kit
from genlm_core.testing.live import check_live_sequences
from genlm_core.testing.tokenizers import toy_tokenizer

recurrent = pytest.importorskip("genlm_example.recurrent", reason="pip install -e examples/plugin_template")


def toy(**options):
    return recurrent.RecurrentLM(toy_tokenizer(), timeout=0.001, **options)


def uncached(lm, ids):
    return lm.next_token_logprobs_uncached(list(ids))


def rows(lm, contexts):
    return lm.batch_next_token_logprobs_sync(contexts)


def close(lm, row, ids) -> bool:
    """``row`` against the uncached row, to a bound (asserted and recorded; True to sit in an ``assert``).

    Both compute the same states (the same elementwise ops on the same values: bit for bit), then logits
    as dot products of ``dim`` float32 terms in different kernels (``[B, dim] @ out`` against
    ``[dim] @ out``): each off by :func:`bounds.sum_error` of ``dim + 1`` terms and ``sum_k |s_k out_kj|
    <= sum_k |out_kj|`` (``|s_k| <= 1``: tanh). A logit error ``e`` moves a log-probability by at most
    ``2 max e`` (its own and the normaliser's), so two computations differ by ``4 max e`` before the two
    float32 log_softmaxes (:func:`bounds.log_softmax_difference` at the row's most negative entry)."""
    want = uncached(lm, ids)
    dot = bounds.sum_error(lm.out.shape[0] + 1, float(lm.out.abs().sum(0).max()))
    tol = bounds.Bound(
        4 * float(dot) + float(bounds.log_softmax_difference(lm.vocab_size, float(want.min()))),
        f"4 x float32 dot products of {lm.out.shape[0]} terms + two float32 log_softmax over V={lm.vocab_size}",
    )
    bounds.within("live: row vs uncached row", bounds.row_difference(row, want), tol, f"context {list(ids)}")
    return True


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"live": {"lookback": 3}},
        {"batch_size": 4, "sequences": 9},  # steps split into batches; sequence ids run out: evictions
        {"batch_size": 6, "positions": 150},  # the engine's room runs out: evictions, batches computed alone
        {"live": {"max_idle_batches": 1, "max_sequences": 8}},
        {"batch_size": 16, "sequences": 5},  # fewer sequences than a batch: batches run in parts
    ],
)
def test_the_shared_particle_check_passes_on_the_toy_engine(options):
    lm = toy(**options)
    steps = 20 if options.get("sequences") == 5 else 50  # most rows fresh there: a shorter program
    stats = check_live_sequences(lm, lm.sequences, in_use=lambda: len(lm.states.held), steps=steps)
    if "sequences" in options or "positions" in options:
        assert stats.evicted > 0
    else:
        assert stats.tokens_computed < 2 * stats.rows  # most rows computed one token
    if "positions" in options or options.get("sequences") == 5:
        assert stats.alone > 0
    # the program's batches only: the reference rows ran none (they used to count one batch each)
    per_step = -(-13 // options.get("batch_size", 32))  # 12 particles and a repeated context at most
    assert stats.batches == lm.sequences.stats.batches <= 2 * per_step * steps
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
    with pytest.raises(AssertionError, match="live: served vs uncached"):
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
        assert close(lm, row, context)


def test_a_sequence_nobody_continues_stays_live_until_evicted_oldest_first():
    lm = toy(batch_size=2, sequences=3)
    rows(lm, [(1, 2), (3, 4)])
    rows(lm, [(5, 6)])  # three live: (1, 2) is the oldest
    s = lm.sequences.stats
    row = rows(lm, [(3, 4, 1), (7, 8)])  # continues (3, 4); (7, 8) needs an id: (1, 2) goes
    assert (s.continued, s.evicted) == (1, 1)
    assert close(lm, row[1], (7, 8))
    row = rows(lm, [(1, 2, 3)])  # (1, 2) was evicted: computed fresh, never from a stale sequence
    assert s.continued == 1 and close(lm, row[0], (1, 2, 3))


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
        assert close(lm, row, context)


def test_a_batch_that_does_not_fit_is_computed_one_request_at_a_time():
    lm = toy(batch_size=4, positions=12)
    contexts = [tuple(range(10 * i + 1, 10 * i + 7)) for i in range(4)]  # 24 states: never at once
    got = rows(lm, contexts)
    assert lm.sequences.stats.alone == 4
    for context, row in zip(contexts, got):
        assert close(lm, row, context)
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
    assert isinstance(out[1], Failed) and close(lm, out[0], (7, 8))
    assert set(map(len, lm.states.held.values())) == {2}  # only (7, 8) stays live
    got = rows(lm, [(1, 2, 5), (7, 8, 1)])
    assert lm.sequences.stats.continued == 1
    assert close(lm, got[0], (1, 2, 5))
    assert close(lm, got[1], (7, 8, 1))


def check(lm, steps=20):
    return check_live_sequences(lm, lm.sequences, in_use=lambda: len(lm.states.held), steps=steps)


def with_engine(lm, engine):
    lm.states = engine
    lm.sequences = LiveSequences(engine, lm.options.live)
    return lm


class IgnoresItsState(recurrent.StateSequences):
    """Planted bug: a recurrent engine whose run starts every piece from the empty state, not from the
    states its sequence holds."""

    def run(self, pieces, make_room):
        for piece in pieces:
            states, state = self.held.setdefault(piece.seq, []), None
            for token in piece.new_tokens:
                state = self.model.step(state, token)
                states.append(state)
        return Ran(torch.stack([self.held[p.seq][-1] for p in pieces]) @ self.model.out)


class RecomputingCopy(recurrent.StateSequences):
    """Planted bug: copy() says it copied but keeps nothing; run() recomputes the prefix from the
    request's tokens. Every row is right; the stats count the prefix as copied."""

    def copy(self, source, target, length):
        self.held[target] = []
        return True

    def run(self, pieces, make_room):
        for piece in pieces:
            states = self.held.setdefault(piece.seq, [])
            for token in piece.request.token_ids[len(states) : piece.start]:
                states.append(self.model.step(states[-1] if states else None, token))
        return super().run(pieces, make_room)


class DefaultReference(recurrent.RecurrentLM):
    """Planted bug: the reference left to AsyncLM's default (forward_batch: the live path)."""

    forward_uncached = AsyncLM.forward_uncached


def test_planted_an_engine_that_ignores_its_state_fails_the_check():
    lm = toy()
    with_engine(lm, IgnoresItsState(lm, 64, None))
    with pytest.raises(AssertionError, match=r"live: served vs uncached: .* the row of a context of \d+ tokens"):
        check(lm)


def test_planted_a_copy_that_recomputes_fails_the_check():
    lm = toy(batch_size=4)  # siblings in later batches: prefix copies
    with_engine(lm, RecomputingCopy(lm, 64, None))
    with pytest.raises(AssertionError, match=r"RecomputingCopy evaluated \d+ positions but the stats count \d+"):
        check(lm)
    lm = toy(batch_size=4)  # the same program on the honest engine passes
    assert check(lm).tokens_copied > 0


def test_planted_a_reference_left_to_the_default_is_refused_before_anything_runs():
    lm = DefaultReference(toy_tokenizer(), timeout=0.001)
    with pytest.raises(TypeError, match=r"DefaultReference\.forward_uncached is AsyncLM's default"):
        check(lm)
    assert lm.sequences.stats.batches == 0


def test_planted_without_the_refusal_the_state_ignoring_engine_is_caught_by_its_reference(monkeypatch):
    """With the default reference, the engine that ignores its state gives the same wrong rows as its
    reference; the refusal is one guard, the reference touching the live path another."""
    lm = DefaultReference(toy_tokenizer(), timeout=0.001)
    with_engine(lm, IgnoresItsState(lm, 64, None))
    monkeypatch.setattr(live_kit, "check_reference", lambda lm: None)
    with pytest.raises(AssertionError, match=r"DefaultReference\.forward_uncached ran the live sequences"):
        check(lm)


class LastState(LiveEngine[int, torch.Tensor]):
    """A recurrent engine that keeps only each sequence's last state (the rule in LiveEngine's docs):
    it copies a whole sequence (a fork) and nothing shorter."""

    copies_any_prefix = False

    def __init__(self, model, sequences):
        self.model = model
        self.free = list(range(sequences))
        self.held: dict[int, tuple[int, torch.Tensor | None]] = {}

    def take(self):
        return self.free.pop() if self.free else None

    def release(self, seqs):
        assert len(set(seqs)) == len(seqs) and not set(seqs) & set(self.free), seqs  # each once
        for seq in seqs:
            self.held.pop(seq, None)
            self.free.append(seq)

    def copy(self, source, target, length):
        held = self.held.get(source, (0, None))
        if length != held[0]:
            return False
        self.held[target] = held
        return True

    def run(self, pieces, make_room):
        out = []
        for piece in pieces:
            n, state = self.held.get(piece.seq, (0, None))
            assert n == piece.start
            for token in piece.new_tokens:
                state = self.model.step(state, token)
            self.held[piece.seq] = (len(piece.request.token_ids), state)
            out.append(state)
        return Ran(torch.stack(out) @ self.model.out)

    def evaluated_tokens(self):
        return self.model.steps


def test_an_engine_that_keeps_only_its_last_state_passes_and_computes_more():
    lm = toy(batch_size=4)
    with_engine(lm, LastState(lm, 64))
    stats = check(lm, steps=40)
    full = check(toy(batch_size=4), steps=40)
    assert stats.copied == 0 and stats.forked > 0  # forks copy a whole sequence; shorter prefixes never
    assert full.copied > 0 and stats.fresh > full.fresh and stats.tokens_computed > full.tokens_computed


def test_the_reference_rows_count_in_no_stat():
    lm = toy()
    rows(lm, [(1, 2, 3)])
    before = lm.sequences.stats.as_dict()
    steps = lm.steps
    uncached(lm, (1, 2, 3, 4))
    assert lm.sequences.uncached(Request((1, 2, 3, 4))).shape == (1, lm.vocab_size)
    assert lm.sequences.stats.as_dict() == before and lm.steps == steps + 4  # uncached() ran the engine once
    assert len(lm.states.held) == 1  # and gave its sequence back


def assert_stats_add_up(s):
    assert s.rows == s.continued + s.forked + s.copied + s.fresh, s


@pytest.mark.parametrize("sequences", [1, 5])
def test_a_batch_larger_than_the_engine_runs_in_parts_with_right_rows_and_stats(sequences):
    lm = toy(batch_size=12, sequences=sequences)
    contexts = [(i + 1, i + 2, i + 3) for i in range(12)]
    got = rows(lm, contexts)
    s = lm.sequences.stats
    assert (s.batches, s.rows, s.fresh, s.alone) == (1, 12, 12, 12)
    assert_stats_add_up(s)
    grown = [(*c, 7) for c in contexts] + [(*contexts[-1], 8)]  # the last part's sequences are live: continued
    got2 = rows(lm, grown)
    assert s.rows == 25 and s.continued > 0
    assert_stats_add_up(s)
    for context, row in zip(contexts + grown, [*got, *got2]):
        assert close(lm, row, context)
    assert len(lm.states.held) <= sequences


def test_live_off_with_fewer_sequences_than_a_batch_runs_in_parts():
    lm = toy(batch_size=8, sequences=3, live={"enabled": False})
    contexts = [(i + 1, i + 5) for i in range(8)]
    got = rows(lm, contexts)
    s = lm.sequences.stats
    assert (s.rows, s.fresh, s.alone, s.tokens_computed) == (8, 8, 8, 16) and not lm.states.held
    for context, row in zip(contexts, got):
        assert close(lm, row, context)


def test_a_failed_batch_counts_no_rows():
    lm = toy(batch_size=4)
    lm.sequences = LiveSequences(Failing(lm.states), lm.options.live)
    with pytest.raises(RuntimeError, match="engine error"):
        rows(lm, [(1, 2), (3, 13)])
    s = lm.sequences.stats
    assert (s.batches, s.rows) == (1, 0)
    assert_stats_add_up(s)
