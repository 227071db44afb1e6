"""Core's KV reuse: the batch layout and gather index (plan_batch, pack_shared, plan_merged), and the
forward step run through the backend protocol by a small numpy attention model, against that model's
uncached, unbatched forward pass."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from genlm_core.kv_reuse import (
    Entry,
    KVBlock,
    KVReuse,
    KVReuseOptions,
    KVRow,
    pack_shared,
    plan_batch,
    plan_merged,
)
from genlm_core.request import Request
from genlm_core.testing import bounds


def make_block(rows, length, mask=None):
    kv = [(np.zeros((rows, 1, length, 2)), np.zeros((rows, 1, length, 2)))]
    return KVBlock(kv, np.ones((rows, length), bool) if mask is None else np.asarray(mask, bool))


# ---- layout and gather index -----------------------------------------------------------------


def test_plan_batch_left_pads_new_tokens_and_gathers_each_rows_past_right_aligned():
    a, b = make_block(2, 5), make_block(1, 3)
    rows = [
        KVRow((1, 2, 3, 4, 5, 6), done=5, entry=Entry(a, 1)),  # one new token after 5 cached
        KVRow((7, 8, 9, 10, 11), done=3, entry=Entry(b, 0)),  # two new tokens after 3 cached
        KVRow((12, 13, 14)),  # nothing cached: three new tokens
        KVRow((1, 2, 3, 4, 5, 20), done=5, entry=Entry(a, 0)),
    ]
    plan = plan_batch(rows)
    assert plan.width == 3 and plan.past.length == 5 and plan.past.block is None
    np.testing.assert_array_equal(plan.input_ids, [[0, 0, 6], [0, 10, 11], [12, 13, 14], [0, 0, 20]])
    np.testing.assert_array_equal(plan.new_mask, [[0, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    np.testing.assert_array_equal(plan.positions, [[0, 0, 5], [0, 3, 4], [0, 1, 2], [0, 0, 5]])
    np.testing.assert_array_equal(plan.past.mask, [[1] * 5, [0, 0, 1, 1, 1], [0] * 5, [1] * 5])
    gather = plan.past.gather
    assert (gather.rows, gather.length, gather.room, gather.complete) == (4, 5, 3, False)  # row 2: zeros
    (pa, pb), last = gather.parts, [0, 0, 0]  # room (and pads) repeat a row's first column
    assert pa.block is a and pa.rows.tolist() == [1, 0] and pa.into.tolist() == [0, 3] and pa.at == 0
    np.testing.assert_array_equal(pa.columns, [[0, 1, 2, 3, 4, *last]] * 2)
    assert pb.block is b and pb.rows.tolist() == [0] and pb.into.tolist() == [1]
    np.testing.assert_array_equal(pb.columns, [[0, 0, 0, 1, 2, *last]])
    assert gather.whole() is None and plan.tree is None
    assert plan.outputs == [(0, 2), (1, 2), (2, 2), (3, 2)]
    step = plan.step(None)
    np.testing.assert_array_equal(step.keys, np.concatenate([plan.past.mask, plan.new_mask], axis=1))
    assert step.room and step.sees is None and step.past_length == 5


def test_a_step_is_plain_only_when_the_models_defaults_are_its_mask_and_positions():
    """Plain: no pad, no hole, causal, each row's new tokens at past_length, past_length + 1, ... (what a
    model given no mask and no positions assumes); and the outputs each row's last, in order."""
    a, holes = make_block(3, 4), make_block(2, 5, [[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    extend = [KVRow((1, 2, 3, 4, 9), done=4, entry=Entry(a, b)) for b in range(3)]  # the block's rows, in order
    resampled = [KVRow((1, 2, 3, 4, 9), done=4, entry=Entry(a, b)) for b in (2, 2, 0)]  # gathered
    fresh = [KVRow((5, 6, 7)), KVRow((8, 9, 10))]
    for rows in (extend, resampled, fresh):
        step = plan_batch(rows).step(None)
        assert step.plain() and step.outputs_last_in_order()
    ragged = [KVRow((1, 2, 3, 4, 9), done=4, entry=Entry(a, 0)), KVRow((1, 2, 3, 4, 9, 9), done=4, entry=Entry(a, 1))]
    shorter = [KVRow((1, 2, 3, 4, 9), done=4, entry=Entry(a, 0)), KVRow((1, 2, 9), done=2, entry=Entry(a, 1))]
    holed = [
        KVRow((1, 2, 3, 4, 9), done=4, entry=Entry(holes, 0)),
        KVRow((1, 2, 3, 4, 5, 9), done=5, entry=Entry(holes, 1)),
    ]
    for rows in (ragged, shorter, holed):
        assert not plan_batch(rows).step(None).plain()
    step = plan_batch(extend).step(None)
    keys = step.keys.copy()
    keys[1, 2] = False  # a key that is not a token, though every position follows the past
    assert not dataclasses.replace(step, keys=keys).plain()
    packed, where = pack_shared(
        [KVRow((1, 2, 3, 4, 7, 8), 4, Entry(a, 0)), KVRow((1, 2, 3, 4, 7, 9), 4, Entry(a, 0))], 8
    )
    step = plan_batch(packed, where).step(None)
    assert not step.plain() and not step.outputs_last_in_order()  # a tree mask; outputs inside the row
    step = plan_batch(extend, [(1, 0), (0, 0), (2, 0)]).step(None)
    assert step.plain() and not step.outputs_last_in_order()  # rows out of order


def test_gather_skips_holes_and_takes_a_packed_sequences_own_columns():
    holes = make_block(2, 6, [[0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    packed = Entry(holes, 1, np.array([0, 2, 5]))
    plan = plan_batch([KVRow((1, 2, 3, 4), 3, Entry(holes, 0)), KVRow((5, 6, 7, 8), 3, packed)])
    (part,) = plan.past.gather.parts
    np.testing.assert_array_equal(part.columns, [[1, 3, 4, 1], [0, 2, 5, 0]])
    assert plan.past.gather.complete and plan.past.gather.whole() is part  # one part, rows in order: the past


@pytest.mark.parametrize(("sources", "whole"), [([0, 1], True), ([1, 0], False), ([0, 0], False)])
def test_plan_batch_reuses_a_block_as_it_is_when_the_batch_is_its_rows(sources, whole):
    block = make_block(2, 4)
    rows = [KVRow((1, 2, 3, 4, 9 + i), done=4, entry=Entry(block, src)) for i, src in enumerate(sources)]
    plan = plan_batch(rows)
    assert (plan.past.block is block) == whole and (plan.past.gather is None) == whole
    assert plan.step(block.kv).room is not whole
    packed_entry = [KVRow((1, 2, 3, 4, 9 + i), done=4, entry=Entry(block, i, np.arange(4))) for i in range(2)]
    assert plan_batch(packed_entry).past.block is None  # a packed row's entry is part of its row


def test_a_block_with_many_holes_is_gathered_not_reused():
    """Holes over a quarter of the block (and over 8): gathering the real positions costs less than
    attending over the holes again, so the past is compacted even though the batch is the block's rows."""
    for holes, reused in ((11, False), (10, True)):  # holes over 8 and over a quarter of 40, or not
        mask = np.ones((2, 40), bool)
        mask[:, :holes] = False
        block = make_block(2, 40, mask)
        rows = [KVRow(tuple(range(40 - holes)) + (i,), done=40 - holes, entry=Entry(block, i)) for i in range(2)]
        plan = plan_batch(rows)
        assert (plan.past.block is block) == reused and plan.past.length == (40 if reused else 40 - holes)


def test_pack_shared_runs_each_shared_token_once_and_plans_a_tree():
    block = make_block(1, 2)
    sequences = [(1, 2, 5), (1, 2, 5, 6), (1, 2, 5, 7), (1, 2, 8), (3, 4)]
    entry = Entry(block, 0)
    rows = [KVRow(ids, done=2, entry=entry) for ids in sequences[:4]] + [KVRow(sequences[4])]
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
    step = plan.step(None)  # each new token sees its row's past and its ancestors
    np.testing.assert_array_equal(step.sees[0], np.concatenate([np.ones((4, 2), bool), sees], axis=1))
    np.testing.assert_array_equal(step.sees[1, :, :2], np.zeros((4, 2), bool))
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
        KVRow((*shared, 1, 7), done=101, entry=Entry(a, 0)),
        KVRow((*shared, 2, 3, 8, 9), done=102, entry=Entry(a, 1)),
        KVRow((*shared, 4, 6), done=101, entry=Entry(b, 0)),
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
        np.testing.assert_array_equal(np.flatnonzero(plan.past.seen[j]), m.prefixes[own])
    np.testing.assert_array_equal(plan.tree[0], [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]])
    # every merged position comes from exactly one source column holding that very prefix
    gather = plan.past.gather
    assert (gather.rows, gather.length, gather.room, gather.complete) == (1, 104, 4, True)
    at = {}
    for part in gather.parts:
        assert part.into.tolist() == [0] and len(part.rows) == 1
        for j, c in enumerate(part.columns[0]):
            assert part.at + j not in at
            at[part.at + j] = (part.block, int(part.rows[0]), int(c))
    assert sorted(at) == list(range(104))
    assert at[100] == (a, 0, 102) and at[101] == (a, 1, 101) and at[102] == (a, 1, 102) and at[103] == (b, 0, 100)
    assert at[0] == (a, 0, 2)  # the first source of the shared prefix: a's row 0, after its holes
    step = plan.step(None)
    assert step.keys.all() and step.sees.shape == (1, 4, 108)


def test_plan_merged_lists_only_sources_that_add_positions():
    """A sequence whose whole prefix is in an earlier row's (here: a prefix of it, stored in another
    block) takes every past position from that row: its own block is no source."""
    shared = tuple(range(10, 110))
    a = make_block(1, 102)  # (shared, 1, 2)
    b = make_block(1, 101)  # (shared, 1): the same tokens, computed in another batch
    rows = [KVRow((*shared, 1, 2, 7), done=102, entry=Entry(a, 0)), KVRow((*shared, 1, 8), done=101, entry=Entry(b, 0))]
    plan = plan_merged(rows)
    assert plan.merged.length == 102 and {part.block for part in plan.past.gather.parts} == {a}
    np.testing.assert_array_equal(plan.merged.prefixes[1], range(101))


def test_plan_merged_declines_when_rows_share_little_or_reuse_one_block():
    """Particles of an SMC step (one new token each after pasts that share only a prompt) keep the
    padded layout: merging would attend over every particle's past for every token."""
    block = make_block(8, 60)
    prompt = tuple(range(1, 21))
    rows = [KVRow((*prompt, *range(100 * i, 100 * i + 40), 5), done=60, entry=Entry(block, i)) for i in range(8)]
    assert plan_merged(rows) is None


def test_causal_attention_hides_pads_and_holes_and_lets_a_pad_see_itself():
    block = make_block(2, 2, [[0, 1], [1, 1]])
    step = plan_batch([KVRow((1, 2, 3), 1, Entry(block, 0)), KVRow((4, 5, 6), 2, Entry(block, 1))]).step(None)
    # past length 2 (row 0 has a hole), width 2 (row 1 has one pad)
    np.testing.assert_array_equal(step.attention()[0], [[0, 1, 1, 0], [0, 1, 1, 1]])
    np.testing.assert_array_equal(step.attention()[1], [[1, 1, 1, 0], [1, 1, 0, 1]])


# ---- the forward step through the protocol, against an uncached forward pass ------------------


class NumpyAttention(KVReuse):
    """A two-layer, one-head attention model in float64 numpy, written against the KV-reuse protocol
    the way a backend is: :meth:`gather_kv`, :meth:`run_step` and :meth:`adapter_context`. Each
    layer's keys and values are its input (so layer 2's depend on the whole context); an adapter
    shifts the embedding."""

    DIM, VOCAB, LAYERS = 8, 40, 2

    def __init__(self, packs: bool = True, **options):
        rng = np.random.default_rng(0)
        self.embed = rng.normal(size=(self.VOCAB, self.DIM))
        self.position = rng.normal(size=(512, self.DIM)) * 0.5
        self.head = rng.normal(size=(self.DIM, self.VOCAB))
        self.shift = {None: 0.0, "a": 0.7, "b": -1.3}
        self.adapter: str | None = None
        self.packs_shared_tokens = packs
        self.plans = []
        self.init_kv_reuse(KVReuseOptions(**options))

    @contextlib.contextmanager
    def adapter_context(self, adapter):
        self.adapter = adapter
        yield
        self.adapter = None

    def reference(self, ids, adapter=None, dtype=np.float64):
        """The uncached, unbatched forward pass: logits after ``ids`` (in ``dtype``: ``np.longdouble``
        measures the float64 pass's own rounding error)."""
        embed, position, head = (x.astype(dtype) for x in (self.embed, self.position, self.head))
        h = embed[list(ids)] + dtype(self.shift[adapter]) + position[: len(ids)]
        for _ in range(self.LAYERS):
            h = h + attend(h, h, np.tri(len(ids), dtype=bool))
        return h[-1] @ head

    def gather_kv(self, gather):
        size = gather.length + gather.room
        shape = (gather.rows, 1, size, self.DIM)
        past = [(np.zeros(shape), np.zeros(shape)) for _ in range(self.LAYERS)]
        for part in gather.parts:
            end = part.at + part.columns.shape[1]
            for (k, v), (sk, sv) in zip(past, part.block.kv):
                k[part.into, :, part.at : end] = sk[part.rows[:, None, None], [[[0]]], part.columns[:, None, :]]
                v[part.into, :, part.at : end] = sv[part.rows[:, None, None], [[[0]]], part.columns[:, None, :]]
        return past

    def run_step(self, step):
        h = self.embed[step.input_ids] + self.shift[self.adapter] + self.position[step.positions]
        sees, end = step.attention(), step.past_length + step.width
        kv = []
        for layer in range(self.LAYERS):
            if step.past is None:
                keys = h
            elif step.room:  # written into the gathered past, as hf does
                keys = step.past[layer][0][:, 0, :end]
                keys[:, step.past_length :] = h
            else:  # a stored block is never written
                keys = np.concatenate([step.past[layer][0][:, 0], h], axis=1)
            kv.append((keys[:, None], keys[:, None]))
            h = h + attend(h, keys, sees)
        rows, columns = zip(*step.outputs)
        return torch.from_numpy(h[list(rows), list(columns)] @ self.head), kv

    def forward_new(self, plan):
        self.plans.append(plan)
        return super().forward_new(plan)

    def rows(self, contexts, adapters=None):
        adapters = adapters or [None] * len(contexts)
        return self.kv_forward_batch([Request(tuple(c), a) for c, a in zip(contexts, adapters)])


def attend(queries, keys, sees):
    scores = np.where(sees, queries @ np.swapaxes(keys, -1, -2) / np.sqrt(queries.shape[-1]), -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ keys


def check(model, contexts, adapters=None, float32_rows=False):
    """Each row against the uncached float64 pass. Two float64 computations of one model (the cached,
    batched, padded one and the reference) differ by accumulation order: :func:`bounds.model_difference`
    of the reference's own rounding error, measured against an extended-precision run (x86's 80-bit
    long double; where long double is float64 that measures 0 and the floor below is the bound), with
    a floor of 8 roundings of the largest logit. Rows of several adapters come back float32: plus the
    float32 rounding of each logit, ``U32 |x|``."""
    rows = model.rows(contexts, adapters)
    adapters = adapters or [None] * len(contexts)
    refs = [model.reference(ids, adapter) for ids, adapter in zip(contexts, adapters)]
    own = max(
        float(np.abs(ref - model.reference(ids, adapter, np.longdouble)).max())
        for ref, ids, adapter in zip(refs, contexts, adapters)
    )
    largest = max(float(np.abs(ref).max()) for ref in refs)
    tol = bounds.Bound(
        float(bounds.model_difference(own, what="a float64 numpy attention"))
        + 8 * bounds.U64 * largest
        + (bounds.U32 * largest if float32_rows else 0.0),
        f"4 x float64-vs-long-double error {own:.3g} + 8 U64 x |logit| {largest:.3g}"
        + (" + float32 rows: U32 |logit|" if float32_rows else ""),
    )
    for row, ids, ref in zip(rows, contexts, refs):
        bounds.within("kv reuse: row vs uncached pass", float(np.abs(row.double().numpy() - ref).max()), tol, f"{ids}")


@pytest.mark.parametrize("packs", [False, True])
def test_smc_steps_resampling_and_ragged_batches_match_the_uncached_pass(packs):
    model = NumpyAttention(packs)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, 40, 30)]
    check(model, [prompt])
    particles = [prompt + [i] for i in range(6)]
    check(model, particles)
    for step in range(8):
        if step % 2:  # resampled: duplicated and reordered parents, then distinct children
            parents = [particles[i] for i in (5, 5, 0, 2, 2, 1)]
            particles = [p + [k] for k, p in enumerate(parents)]
        else:  # every particle extended in order: the last batch's block is the past as it is
            particles = [p + [int(rng.integers(40))] for p in particles]
        before = model.tokens_computed
        check(model, particles)
        assert model.tokens_computed - before == len(particles)  # one new token per particle
        assert (model.plans[-1].past.block is not None) == (step % 2 == 0)
    mixed = [prompt[:7] + [1, 2, 3], particles[0] + [4], [5, 6], prompt + [9] * 12]
    check(model, mixed)  # rows from two blocks, two with nothing cached: one gathered past
    gather = model.plans[-1].past.gather  # (or, where rows may be merged, one row over a merged past)
    assert gather is not None and (packs or (len(gather.parts) == 2 and not gather.complete))


def test_packed_rows_and_merged_pasts_match_the_uncached_pass():
    model = NumpyAttention()
    prompt = [(7 * i) % 40 for i in range(60)]
    check(model, [prompt])
    lookahead = [prompt + [5], prompt + [5, 6], prompt + [5, 7], prompt + [5, 7, 9], prompt + [8], [30, 31]]
    before = model.tokens_computed
    check(model, lookahead)  # 5, 6, 7, 9, 8 once each, in one tree row; the unrelated context alone
    assert model.tokens_computed - before == 5 + 2 and model.plans[-1].tree is not None
    check(model, [prompt + [1, 2]])  # another block
    before = model.tokens_computed
    beam = [prompt + [5, 7, 3], prompt + [1, 2, 4], prompt + [8, 8]]
    check(model, beam)  # one row over the shared prefix, held once
    assert model.plans[-1].merged is not None and model.plans[-1].merged.length == 60 + 5
    assert model.tokens_computed - before == 3
    for grown in (prompt + [5, 7, 3, 1], prompt + [8, 8, 2]):  # entries of a merged row are reused
        before = model.tokens_computed
        check(model, [grown])
        assert model.tokens_computed - before == 1


def test_holes_are_squeezed_out_and_chunks_prefill_long_contexts():
    model = NumpyAttention(packs=False, prefill_chunk_size=16)
    a, b = [7, 8, 9], [7, 8, 10]
    for step in range(30):
        a, b = (a + [3, 4, 5], b + [step % 40]) if step % 2 else (a + [step % 40], b + [3, 4, 5])
        check(model, [a, b])
    block = model.kv.longest_prefix(None, tuple(a), len(a)).value.block
    assert len(a) == 63 and block.length <= 1.4 * 63  # left alone it would be 3 + 30 * 3
    long = [(5 * i) % 40 for i in range(100)]
    calls = model.forward_calls
    check(model, [long, a + [1]])
    assert model.forward_calls - calls == 100 // 16 + 1


def test_requests_of_each_adapter_run_under_it_and_keep_their_states_apart():
    model = NumpyAttention()
    prompt = list(range(10, 30))
    contexts = [prompt, prompt + [1], prompt, prompt + [1]]
    check(model, contexts, [None, None, "a", "b"], float32_rows=True)  # rows of several adapters come back float32
    assert len(model.plans) == 3  # one pass per adapter
    before = model.tokens_computed
    check(model, [prompt + [1, 2]], ["a"])  # a's prompt is reused, not b's or the base model's prompt + [1]
    assert model.tokens_computed - before == 2
    assert model.kv.longest_prefix("b", tuple(prompt + [1, 2])).length == 21
