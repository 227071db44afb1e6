"""Context handles (genlm_core.context): a read-only Sequence[int] that behaves as the tuple of its ids.

Every property is checked against that tuple (the reference) on randomised histories of extensions,
prefixes and slices; requests of handles against requests of lists, tuples and arrays of the same ids.
"""

from __future__ import annotations

import asyncio
import pickle
import random

import numpy as np
import pytest
import torch

from genlm_core import Context, load_model_by_name
from genlm_core.context import CHUNK, sample_hash
from genlm_core.request import Request, context_hash

V = 1000


def histories(seed: int, count: int):
    """``count`` (context, reference tuple) pairs, each grown by random extensions of 1..2*CHUNK ids
    from a random root, with random prefixes taken along the way."""
    rng = random.Random(seed)
    for _ in range(count):
        ref = [rng.randrange(V) for _ in range(rng.randrange(0, 3 * CHUNK))]
        ctx = Context(ref, V)
        for _ in range(rng.randrange(1, 200)):
            k = rng.choice([1, 1, 1, 2, 7, CHUNK - 1, CHUNK + 3])
            new = [rng.randrange(V) for _ in range(k)]
            ctx = ctx.extend(new[0]) if k == 1 else ctx + new
            ref += new
            if rng.random() < 0.1:
                cut = rng.randrange(0, len(ref) + 1)
                ctx, ref = ctx.prefix(cut), ref[:cut]
        yield ctx, tuple(ref), rng


def test_a_context_behaves_as_the_tuple_of_its_ids():
    for ctx, ref, rng in histories(0, 150):
        assert len(ctx) == len(ref) and tuple(ctx) == ref and list(ctx) == list(ref) and ctx.ids == ref
        assert ctx == ref and ctx == list(ref) and ref == ctx and list(ref) == ctx and not (ctx != ref)
        assert ctx != ref + (1,) and ctx != list(ref) + [1] and ctx != "abc"
        assert tuple(reversed(ctx)) == ref[::-1] and ctx.tolist() == list(ref)
        assert np.array_equal(np.asarray(ctx), np.asarray(ref, dtype=np.int64).reshape(-1))
        for i in rng.sample(range(-len(ref), len(ref)), min(len(ref) * 2, 30)) if ref else []:
            assert ctx[i] == ref[i]
        for _ in range(20):
            a, b = rng.randrange(-len(ref) - 3, len(ref) + 3), rng.randrange(-len(ref) - 3, len(ref) + 3)
            step = rng.choice([1, 1, 2, -1, 3])
            assert ctx[a:b:step] == ref[a:b:step] and ctx[a:] == ref[a:] and ctx[:b] == ref[:b]
        if ref:
            assert (
                ref[-1] in ctx and ctx.index(ref[-1]) == ref.index(ref[-1]) and ctx.count(ref[0]) == ref.count(ref[0])
            )
        with pytest.raises(IndexError):
            ctx[len(ref)]
        assert pickle.loads(pickle.dumps(ctx)) == ref


def test_equal_ids_hash_alike_however_the_context_was_built():
    for ctx, ref, rng in histories(1, 150):
        rebuilt = Context(ref, V)
        assert ctx == rebuilt and hash(ctx) == hash(rebuilt) == sample_hash(ref)
        cut = rng.randrange(0, len(ref) + 1)
        assert ctx.prefix(cut) == ref[:cut] and hash(ctx.prefix(cut)) == sample_hash(ref[:cut])
        assert Request(ctx) == Request(ref) and hash(Request(ctx, "a")) == context_hash(ref, "a")
        if ref:
            changed = list(ref)
            changed[rng.randrange(len(ref))] ^= 1  # one id differs: never equal, whatever the hashes
            assert ctx != Context(changed, V) and Request(ctx) != Request(tuple(changed))


def test_contexts_that_hash_alike_but_differ_are_not_equal():
    """Two extensions of one root whose ids differ only where the hash does not look (not among the
    last ids, not a sampled position): equal hashes, shared chunks, and still not equal."""
    root = Context(list(range(2 * CHUNK)), V)
    common = list(range(50))
    a, b = root + ([1] + common), root + ([2] + common)
    assert hash(a) == hash(b) and a._chunks is b._chunks
    assert a != b and Request(a) != Request(b) and a == list(range(2 * CHUNK)) + [1] + common


def test_extending_shares_the_parents_storage_and_reads_only_new_ids():
    root = Context(list(range(5 * CHUNK + 3)), V)
    child = root.extend(7)
    assert child._chunks is root._chunks
    siblings = [child.extend(t) for t in (1, 1, 2)]
    assert siblings[0] == siblings[1] and siblings[0] != siblings[2]
    assert siblings[0].prefix(len(child)) is child  # the parent, found directly
    with pytest.raises(ValueError, match="outside the vocabulary"):
        child.extend(V)
    with pytest.raises(TypeError, match=r"position 0 holds 2\.0"):
        child.extend([2.0])
    with pytest.raises(TypeError):
        child.extend(True)
    with pytest.raises(TypeError, match="token id or an iterable"):
        child + "ab"
    with pytest.raises(AttributeError):
        child.ids = (1, 2)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        child.vocab_size = 5  # type: ignore[misc]
    assert child.extend([]) is child and len(Context([], V)) == 0
    assert [5] + Context([1], V) == [5, 1] and (5,) + Context([1], V) == (5, 1)


def test_bad_ids_are_refused_where_a_context_is_made():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Context([1, V], V)
    with pytest.raises(TypeError, match="vocab_size"):
        Context([1, 2])
    with pytest.raises(TypeError):
        Context({1, 2}, V)
    with pytest.raises(TypeError):
        Context([1, 2.5], V)


@pytest.fixture(scope="module")
def lm():
    model = load_model_by_name("gpt2", backend="mock", llm_opts={"batch_size": 64, "seed": 3})
    yield model
    model.cleanup()


def test_a_model_takes_its_own_handles_without_reading_them_and_checks_others_whole(lm):
    ctx = lm.context([1, 2, 3])
    checked, handles = lm.contexts.checked, lm.contexts.handles
    request = lm.request(ctx.extend(4))
    assert request.context == [1, 2, 3, 4] and lm.contexts.handles == handles + 1 and lm.contexts.checked == checked
    big = Context([1, 2, lm.vocab_size + 5], lm.vocab_size + 10)  # checked against a larger vocabulary
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.request(big)
    small = Context([1, 2], 10)  # a smaller vocabulary's ids are this one's too
    assert lm.request(small).context is small
    unchecked = Request((1, 2, lm.vocab_size)).context  # a context nobody checked is checked whole
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.request(unchecked)

    class Forged(Context):  # a subclass may lie about its ids: it is read and checked whole
        def __iter__(self):
            return iter([1, lm.vocab_size + 3])

        def __len__(self):
            return 2

    forged = Forged([1, 2], lm.vocab_size)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.request(forged)
    with pytest.raises(ValueError, match="empty"):
        lm.request(lm.context())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm.context([lm.vocab_size])
    for bad in (5, {1, 2}, "ab", [1.5], [True]):
        with pytest.raises(TypeError, match="token_ids"):
            lm.context(bad)
    assert len(lm.context()) == len(lm.context([])) == 0 and lm.context((1, 2)) == [1, 2]


def test_handles_lists_tuples_and_arrays_of_one_context_share_rows_and_cache_entries(lm):
    """Random contexts asked for in every form, concurrently and one by one: every form gets the
    uncached row of its ids, and each distinct context is computed once."""
    rng = random.Random(5)
    lm.clear_cache()

    async def main():
        for _ in range(6):
            ctx = lm.context([rng.randrange(lm.vocab_size) for _ in range(rng.randrange(1, 300))])
            forms = []
            for _ in range(12):
                ctx = ctx.extend(rng.randrange(lm.vocab_size))
                ids = list(ctx)
                forms += [ctx, ids, tuple(ids), np.asarray(ids), torch.tensor(ids), Context(ids, lm.vocab_size)]
            rng.shuffle(forms)
            items = lm.batcher.stats.items
            rows = await asyncio.gather(*(lm.next_token_logprobs(f) for f in forms))
            assert lm.batcher.stats.items - items == 12  # each context once, whatever its forms
            block = await lm.batch_next_token_logprobs(forms)
            for form, row, again in zip(forms, rows, block, strict=True):
                reference = lm.next_token_logprobs_uncached(list(map(int, form)))
                assert torch.equal(row, reference) and torch.equal(again, reference)

    asyncio.run(main())


def test_a_step_is_one_submission_and_its_block_is_the_rows_as_computed(lm):
    lm.clear_cache()
    contexts = [lm.context([7, i]) for i in range(40)]

    async def main():
        submitted, batches = lm.batcher.stats.submitted, lm.batcher.stats.batches
        block = await lm.batch_next_token_logprobs(contexts)
        assert lm.batcher.stats.batches == batches + 1 and lm.batcher.stats.submitted == submitted + 40
        assert block.shape == (40, lm.vocab_size) and block._base is not None  # a view, not a stacked copy
        again = await lm.batch_next_token_logprobs([contexts[3], contexts[3], [7, 3], contexts[0]])
        for row, i in zip(again, [3, 3, 3, 0], strict=True):
            assert torch.equal(row, lm.next_token_logprobs_uncached([7, i]))
        assert lm.batcher.stats.batches == batches + 1  # all four from the output cache
        for i in range(40):
            assert torch.equal(block[i], lm.next_token_logprobs_uncached([7, i]))

    asyncio.run(main())


def test_a_cancelled_step_drops_its_requests_and_a_failing_one_fails_only_its_caller(lm):
    lm.clear_cache()

    async def main():
        step = asyncio.ensure_future(lm.batch_next_token_logprobs([[9, i] for i in range(10)]))
        await asyncio.sleep(0)
        assert len(lm.batcher.queued()) == 10
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert lm.batcher.queued() == []
        items = lm.batcher.stats.items
        other = asyncio.ensure_future(lm.next_token_logprobs([9, 1]))
        failing = asyncio.ensure_future(lm.batch_next_token_logprobs([[9, 1], [9, 2]]))
        original = lm.forward_batch

        def fail_second(requests):
            out = list(original(requests))
            return [
                Failed(RuntimeError("row failed")) if r.token_ids == (9, 2) else row for r, row in zip(requests, out)
            ]

        lm.forward_batch = fail_second
        try:
            with pytest.raises(RuntimeError, match="row failed"):
                await failing
            assert torch.equal(await other, lm.next_token_logprobs_uncached([9, 1]))
        finally:
            del lm.forward_batch
        assert lm.batcher.stats.items == items + 2
        assert torch.equal(await lm.next_token_logprobs([9, 2]), lm.next_token_logprobs_uncached([9, 2]))

    from genlm_core.rows import Failed

    asyncio.run(main())


def test_sample_extends_a_handle_and_matches_sampling_from_lists(lm):
    """``sample`` walks a handle; the draws equal those of a loop over plain lists with the same generator."""
    prompt = [5, 6, 7]
    got = asyncio.run(lm.sample(prompt, 12, eos_token_ids=[], temperature=1.0, seed=11))
    generator = torch.Generator().manual_seed(11)
    from genlm_core.lm import sample_token

    context, expected = list(prompt), []
    for _ in range(12):
        token = sample_token(lm.next_token_logprobs_uncached(context), 1.0, generator)
        expected.append(token)
        context.append(token)
    assert got == expected
