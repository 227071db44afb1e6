"""What keeps a step's host cost flat: requests hashed from a sample of ids, contexts checked by their
new token, rows normalised in one pass into reused memory, the cache counting the memory it keeps.

Every check here compares against an independent reference: whole-tuple equality, the full
validation of a fresh model, an uncached float64 log-softmax, the bytes torch reports.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from genlm_core import OutputCache, Request
from genlm_core.request import HASH_SAMPLE, ContextChecker, context_hash
from genlm_core.rows import RowMemory, nan_rows, normalise, rows_block, storage_users
from genlm_core.testing import bounds

from .helpers import BigramLM

# ---- requests ---------------------------------------------------------------------------------


def test_requests_equal_exactly_when_their_contexts_and_adapters_are():
    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(500)]
    for pos in [0, 7, 250, 463, 499]:  # 7, 250: positions the hash does not read
        other = list(base)
        other[pos] = (other[pos] + 1) % 1000
        a, b = Request(tuple(base)), Request(tuple(other))
        assert a != b
        d = {a: "a", b: "b"}  # two keys even where the hashes collide
        assert d[Request(tuple(base))] == "a" and d[Request(tuple(other))] == "b"
    assert Request((1, 2)) == Request((1, 2)) and hash(Request((1, 2))) == hash(Request((1, 2)))
    assert Request((1, 2), "x") != Request((1, 2))
    assert Request((1, 2)).prefix(1) == Request((1,))


def test_a_hash_reads_a_bounded_number_of_ids():
    class Counting(tuple):
        reads = 0

        def __getitem__(self, item):
            out = super().__getitem__(item)
            Counting.reads += len(out) if isinstance(item, slice) else 1
            return out

    for n in [24, 2000, 8000]:
        Counting.reads = 0
        context_hash(Counting(range(n)))
        assert Counting.reads <= 2 * HASH_SAMPLE, (n, Counting.reads)


def test_a_request_is_immutable_and_pickles():
    import pickle

    r = Request((1, 2, 3), "a")
    with pytest.raises(AttributeError):
        r.token_ids = (4,)  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(r)) == r


# ---- checking contexts by their new token -------------------------------------------------------


def test_an_extension_is_checked_in_its_new_token_and_built_from_the_checked_ids():
    checker = ContextChecker(vocab_size=100)
    first = checker.request([5, 6, 7], None)
    assert (checker.checked, checker.extended) == (1, 0)
    second = checker.request([5, 6, 7, 8], None)
    assert second == Request((5, 6, 7, 8)) and checker.extended == 1
    assert all(type(i) is int for i in second.token_ids)
    assert second.token_ids[:3] is not first.token_ids  # a new tuple, equal to the checked ids
    with pytest.raises(ValueError, match="position 4"):
        checker.request([5, 6, 7, 8, 100], None)
    with pytest.raises(ValueError, match="position 0"):
        checker.request([-1, 6, 7, 8, 9], None)  # its prefix was never checked: checked whole
    with pytest.raises(TypeError):
        checker.request([5, 6, 7, 8, True], None)
    with pytest.raises(TypeError):
        checker.request([5, 6, 7, 8, 9.0], None)
    before = checker.checked
    checker.request([5, 6, 7, 8], "lora")  # another adapter: checked whole
    assert checker.checked == before + 1


def test_the_memory_of_checked_contexts_is_bounded_by_tokens():
    checker = ContextChecker(vocab_size=100, max_tokens=50)
    for i in range(20):
        checker.request([1, 2, 3, 4, 5, 6, 7, 8, 9, i], None)
    assert checker.tokens <= 50
    checker.request([1, 2, 3, 4, 5, 6, 7, 8, 9, 19, 1], None)  # the newest is remembered
    assert checker.extended == 1
    checker.request([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1], None)  # the oldest was forgotten: checked whole
    assert checker.checked == 21


async def test_a_model_answers_extensions_as_a_fresh_model_does(toy_tok):
    """Particles extend their own contexts for many steps: every row equals a fresh model's row
    (whose every context is checked whole), and bad ids at the end are refused."""
    lm, fresh = BigramLM(toy_tok, batch_size=8), BigramLM(toy_tok, batch_size=8)
    rng = random.Random(1)
    contexts = [[1, 2] for _ in range(6)]
    for _ in range(20):
        for c in contexts:
            c.append(rng.randrange(lm.vocab_size))
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for c, row in zip(contexts, rows):
            fresh.clear_cache()
            fresh.contexts.clear()
            assert torch.equal(row, fresh.next_token_logprobs_sync(c))
    assert lm.contexts.extended >= 6 * 19
    with pytest.raises(ValueError):
        await lm.next_token_logprobs([*contexts[0], lm.vocab_size])


# ---- rows: one pass, reused memory -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_nan_or_inf_anywhere_in_a_row_is_found_from_one_column(dtype):
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(6, 300, generator=gen).to(dtype)
        bad = set(rng.choice(6, size=rng.integers(0, 4), replace=False).tolist())
        for row in bad:
            kind = rng.integers(3)
            if kind == 0:
                logits[row, rng.integers(290)] = float("nan")
            elif kind == 1:
                logits[row, rng.integers(290)] = float("inf")
            else:
                logits[row] = float("-inf")
        found = nan_rows(normalise(logits, 290))
        assert {i for i, b in enumerate(found) if b} == bad


def test_normalise_into_memory_matches_float64_log_softmax():
    logits = torch.randn(5, 120, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    missing = torch.tensor([3, 50])
    out = torch.empty(5, 100)
    got = normalise(logits, 100, missing, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = logits[:, :100].clone()
    ref[:, [3, 50]] = float("-inf")
    ref = torch.log_softmax(ref, -1)
    # float64 logits rounded to float32 (each off by U32 |x|, which moves a log-probability by at most twice
    # the largest: its own and the normaliser's), then a float32 log_softmax over the 98 finite logits,
    # against a float64 one
    finite = ref.isfinite()
    worst = float(ref[finite].abs().max())
    tol = bounds.Bound(
        2 * bounds.U32 * float(logits[:, :100].abs().max())
        + float(bounds.log_softmax_error(98, worst))
        + float(bounds.log_softmax_error(98, worst, bounds.U64)),
        "float32 rounding of float64 logits + float32 and float64 log_softmax over 98 terms",
    )
    bounds.within("normalise vs float64 log_softmax", bounds.row_difference(got, ref), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalise_of_padded_logits_into_memory_is_the_log_softmax_of_the_kept_columns(dtype):
    """Columns past the vocabulary (a padded model vocabulary) make the rows strided: normalised into
    ``out`` they equal, bit for bit, torch's log_softmax of a contiguous copy of the kept columns."""
    logits = (torch.randn(7, 301, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    out = torch.empty(7, 300)
    got = normalise(logits, 300, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, torch.log_softmax(logits[:, :300].contiguous(), -1, dtype=torch.float32))


def test_a_row_anyone_holds_is_never_written_again():
    memory = RowMemory(probe=4)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    kinds = ["row", "view", "numpy", "none"]
    for step in range(60):
        block = memory.take(3, 16, torch.device("cpu"))
        assert block is not None
        block.copy_(torch.full((3, 16), float(step)))
        kind = kinds[step % 4]
        if kind == "row":
            held.append((block[1], torch.full((16,), float(step))))
        elif kind == "view":
            held.append((block[2, 4:9], torch.full((5,), float(step))))
        elif kind == "numpy":
            array = block[0].numpy()
            held.append((torch.from_numpy(array), torch.full((16,), float(step))))
        del block
    for value, expected in held:
        assert torch.equal(value, expected)
    assert memory.reused > 0  # the blocks nobody kept came back


def test_the_model_reuses_row_memory_once_the_cache_lets_rows_go(toy_tok):
    lm = BigramLM(toy_tok, batch_size=4, cache_size=8)
    kept = lm.next_token_logprobs_sync([1, 2])  # the caller keeps this row
    before = kept.clone()
    for i in range(40):
        lm.batch_next_token_logprobs_sync([[3, i % 50, j] for j in range(4)])
    assert lm.row_memory.reused > 0
    assert torch.equal(kept, before)
    assert storage_users(kept) is not None
    lm.cleanup()
    assert not lm.row_memory._blocks  # cleanup lets go of every block
    assert torch.equal(kept, before)  # a row the caller holds stays as it was


def test_rows_that_are_consecutive_rows_of_one_storage_are_a_view_and_others_a_copy():
    block = torch.randn(6, 10)
    whole = rows_block(list(block))
    assert whole.data_ptr() == block.data_ptr() and torch.equal(whole, block)
    part = rows_block([block[2], block[3], block[4]])
    assert part.data_ptr() == block[2].data_ptr() and torch.equal(part, block[2:5])
    wide = torch.randn(4, 12)[:, :10]  # rows of a wider block: strided, still no copy
    assert rows_block(list(wide)).data_ptr() == wide.data_ptr() and torch.equal(rows_block(list(wide)), wide)
    memory = RowMemory()
    for rows in (
        [block[0], block[2]],  # evenly spaced: a view with a longer stride
        [block[3], block[2]],
        [block[1], block[1], block[4]],  # a row named twice (a resampled batch)
        [block[0], torch.randn(10)],
        [block[1, :5], block[2, :5]],
    ):
        for mem in (None, memory):
            out = rows_block(rows, mem)
            assert torch.equal(out, torch.stack(rows))
    shuffled = [block[i] for i in (0, 1, 3)]
    assert rows_block(shuffled).data_ptr() != block.data_ptr()  # not evenly spaced: copied


def test_a_batch_naming_a_context_twice_is_copied_into_reused_memory_and_a_held_result_is_kept(toy_tok):
    lm = BigramLM(toy_tok, batch_size=8, cache_size=64)
    ref = BigramLM(toy_tok, batch_size=1, cache_size=0)  # one context per forward, nothing cached
    held = []
    for step in range(30):
        contexts = [[1, step % 40, j] for j in (0, 0, 3, 1, 1, 1)]  # duplicates, as after resampling
        if step % 2:
            out = lm.batch_next_token_logprobs_sync(contexts)
        else:
            out = asyncio.run(lm.batch_next_token_logprobs(contexts))
        want = torch.stack([ref.next_token_logprobs_sync(c) for c in contexts])
        assert torch.equal(out, want)
        if step % 5 == 0:
            held.append((out, want))
    assert lm.row_memory.reused > 0
    for out, want in held:  # a block the caller kept is never handed out again
        assert torch.equal(out, want)


# ---- the cache counts the memory it keeps --------------------------------------------------------


def test_rows_of_one_block_count_the_block_once():
    block = torch.zeros(4, 100)
    c = OutputCache(maxsize=100, max_bytes=None)
    for i in range(4):
        c.put(i, block[i])
    assert c.nbytes == block.untyped_storage().nbytes()
    c.put("other", torch.zeros(10))
    assert c.nbytes == block.untyped_storage().nbytes() + 40
    for i in range(3):
        c.put(i, torch.zeros(1))  # replaced: the block is still held by row 3
    assert c.nbytes == block.untyped_storage().nbytes() + 40 + 3 * 4
    c.put(3, torch.zeros(1))
    assert c.nbytes == 40 + 4 * 4


def test_the_byte_bound_holds_for_rows_that_share_blocks():
    c = OutputCache(maxsize=1000, max_bytes=3 * 4 * 100 * 4)  # three blocks of four rows of 100 floats
    blocks = [torch.zeros(4, 100) for _ in range(10)]
    for b, block in enumerate(blocks):
        for i in range(4):
            c.put((b, i), block[i])
        cached = [value for value, _ in c._data.values()]
        assert c.nbytes <= c.max_bytes
        assert c.nbytes == sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in cached}.values())
        assert cached


def test_put_many_counts_and_evicts_as_put_does():
    rng = random.Random(3)
    one, many = OutputCache(maxsize=40, max_bytes=6000), OutputCache(maxsize=40, max_bytes=6000)
    for step in range(30):
        block = torch.zeros(rng.randint(1, 6), 50)
        keys = [(step, i) for i in range(block.shape[0])] + [rng.randint(0, 10)]  # a key replaced too
        values = [*block, torch.zeros(rng.randint(1, 30))]
        for k, v in zip(keys, values):
            one.put(k, v)
        many.put_many(keys, values)
        assert list(one._data) == list(many._data) and one.nbytes == many.nbytes


def test_the_checker_trusts_no_hash_alone(monkeypatch):
    """Every context hashes alike: a candidate prefix is still compared whole, so each request is
    exactly the context given (checked whole where no equal prefix was checked)."""
    import genlm_core.request as request_module
    from genlm_core.validation import check_token_ids

    monkeypatch.setattr(request_module, "context_hash", lambda *args, **kwargs: 7)
    monkeypatch.setattr(request_module.ContextChecker, "_key", staticmethod(lambda request: 7))
    checker = ContextChecker(vocab_size=50)
    rng = random.Random(5)
    contexts = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    for _ in range(300):
        base = contexts[-1] if rng.random() < 0.5 else rng.choice(contexts)  # the newest is the one remembered
        context = [*base, rng.randrange(50)] if rng.random() < 0.7 else [rng.randrange(50) for _ in base]
        if rng.random() < 0.1:
            context[rng.randrange(len(context))] = rng.choice([-1, 50, 2.0, True])
        try:
            expected = check_token_ids(context, 50)
        except (TypeError, ValueError) as error:
            if context[:-1] and all(type(i) is int for i in context[-1:]) and 0 <= context[-1] < 50:
                continue  # a bad id before the last, in a prefix checked before: read by value (documented)
            with pytest.raises(type(error)):
                checker.request(context, None)
            continue
        got = checker.request(context, None)
        assert got.token_ids == expected and all(type(i) is int for i in got.token_ids)
        contexts.append(context)
    assert checker.extended > 30 and checker.checked > 30


def test_threads_are_never_handed_one_block(monkeypatch):
    import threading
    import time

    import genlm_core.rows as rows_module

    counted = rows_module.storage_users

    def slow_count(tensor: torch.Tensor) -> int | None:
        users = counted(tensor)
        time.sleep(1e-4)  # widen the window between looking at a block and handing it out
        return users

    monkeypatch.setattr(rows_module, "storage_users", slow_count)
    memory = RowMemory(probe=8)
    errors: list[str] = []

    def work(me: int) -> None:
        for i in range(100):
            block = memory.take(2, 8, torch.device("cpu"))
            assert block is not None
            block.fill_(float(me * 1000 + i))
            for _ in range(20):
                if not bool((block == float(me * 1000 + i)).all()):
                    errors.append(f"thread {me} step {i}: its block was written by another")
                    return
            del block

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter lets them
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert memory.reused > 0


def test_long_lists_compared_by_address_or_by_value_are_exactly_the_context_given(monkeypatch):
    """Long contexts (over POINTER_COMPARE_MIN) extended, edited in place, rebuilt from other int objects
    of the same values, or given floats and bools: every request is the checked tuple of the caller's
    context at the call, whichever comparison took it; both comparisons are exercised."""
    import genlm_core.request as request_module
    from genlm_core.validation import check_token_ids

    calls = {"address": 0, "same": 0}
    real = request_module.same_objects

    def counting(snapshot, checked):
        calls["address"] += 1
        same = real(snapshot, checked)
        calls["same"] += bool(same)
        return same

    monkeypatch.setattr(request_module, "same_objects", counting)
    vocab = 5000
    checker = ContextChecker(vocab_size=vocab)
    rng = random.Random(9)
    context = [rng.randrange(vocab) for _ in range(request_module.POINTER_COMPARE_MIN + 10)]
    for _ in range(400):
        action = rng.random()
        if action < 0.5:
            context.append(rng.randrange(vocab))
        elif action < 0.6:  # the same values, other int objects (ids above 256 are not shared)
            context = [int(str(i)) for i in context] + [rng.randrange(vocab)]
        elif action < 0.75:  # an earlier position changed in place (to a bad id, sometimes), then a token appended
            context[rng.randrange(len(context))] = rng.choice([rng.randrange(vocab)] * 3 + [vocab, -1, 2.5, 3.0])
            context.append(rng.randrange(vocab))
        elif action < 0.85:
            context = [*context, rng.choice([3.0, True, 2.5, vocab, -1])]
        else:  # a particle that went back a few tokens
            context = context[: max(2, len(context) - rng.randrange(1, 4))]
        try:
            expected = check_token_ids(context, vocab)
        except (TypeError, ValueError) as error:
            with pytest.raises(type(error)):
                checker.request(context, None)
            context = [int(i) for i in context[:-1] if type(i) is int and 0 <= i < vocab]
            continue
        got = checker.request(context, None)
        assert got.token_ids == expected and all(type(i) is int for i in got.token_ids)
        assert got.prefix(len(expected) - 1).token_ids == expected[:-1]  # the checked parent, where it links one
    assert calls["same"] > 50 and calls["address"] > calls["same"] and checker.extended > 100


# ---- live sequences: a step reads no whole context -----------------------------------------------


def test_a_prefix_a_few_tokens_back_is_the_context_it_was_extended_from():
    """A context made by extending (a handle), or by the checker from a checked context and one new id
    (a list), finds its recent prefixes by following what it was made from: the very context, no copy.
    Every prefix of every length equals the slice of the ids, linked or not, and once the contexts it
    was made from are gone it slices."""
    import gc

    from genlm_core.context import PARENT_STEPS, Context

    rng = random.Random(3)
    chain = [Context([rng.randrange(50) for _ in range(300)], 50)]
    for _ in range(PARENT_STEPS + 3):
        chain.append(chain[-1].extend(rng.randrange(50)))
    chain.append(chain[-1].extend([1, 2, 3]))  # several ids at once: one link
    last = chain[-1]
    ids = last.ids
    for length in range(1, len(ids) + 1):
        assert last.prefix(length) == ids[:length]
    linked = {len(c): c for c in chain[-1 - PARENT_STEPS :]}
    for length, context in linked.items():
        assert last.prefix(length) is context
    assert last.prefix(len(chain[0])).ids == chain[0].ids

    checker = ContextChecker(vocab_size=50)
    caller = list(chain[0].ids)
    first = checker.request(caller, None)
    caller.append(7)
    second = checker.request(caller, None)  # by the items' addresses (300 ids)
    assert second.context.prefix(len(first)) is first.context
    short = checker.request([1, 2, 3], None)
    longer = checker.request([1, 2, 3, 4], None)  # by value (under POINTER_COMPARE_MIN)
    assert longer.context.prefix(3) is short.context
    edited = list(caller)
    edited[5] = (edited[5] + 1) % 50  # a position the hash may not read: checked whole, linked to nothing
    third = checker.request([*edited, 9], None)
    assert third.prefix(len(edited)).token_ids == tuple(edited)
    assert third.context.prefix(len(edited)) is not second.context

    kept = second.context.ids
    del first, chain, linked, last
    checker.clear()
    gc.collect()
    assert second.context.prefix(len(kept) - 1) == kept[:-1]  # its parent is gone: a slice


@pytest.mark.parametrize("kind", ["lists", "handles"])
def test_a_live_step_that_continues_and_forks_reads_no_whole_context(monkeypatch, kind):
    """The live index plans and keeps a step of long contexts (continued, forked after resampling,
    one going back a token) without making a context or reading one whole: no context of more than
    a few ids is made, and no request's ids are read (a search over any prefix, with ``arrays``,
    reads them only when a request extends no held context). Every plan is checked against the
    contexts held: the handle continued holds exactly the request less its new tokens. (The first
    step reads the shorter prefixes of contexts that were made whole, once.)"""
    import genlm_core.context as context_module
    from genlm_core.context import Context
    from genlm_core.live_index import LiveIndex

    vocab, length, n = 1000, 3000, 6
    rng = random.Random(5)
    checker = ContextChecker(vocab_size=vocab)
    index: LiveIndex[int] = LiveIndex(lookback=2, arrays=True)
    prompt = [rng.randrange(vocab) for _ in range(length)]
    contexts: list = [list(prompt) + [i] for i in range(n)]
    if kind == "handles":
        contexts = [Context(c, vocab) for c in contexts]
    ask = (lambda c: checker.request(c, None)) if kind == "lists" else (lambda c: Request(c))
    handles = iter(range(10**6))
    for context in contexts:
        index.keep(ask(context), next(handles))
    reads = {"made": 0, "ids": 0}
    real_root, real_make, real_ids = context_module._init_root, context_module._make, Request.token_ids

    def watch(on: bool) -> None:
        if on:
            monkeypatch.setattr(context_module, "_init_root", counting_root)
            monkeypatch.setattr(context_module, "_make", counting_make)
            monkeypatch.setattr(Request, "token_ids", property(counting_ids))
        else:
            monkeypatch.undo()

    def counting_root(ctx, ids, bound):
        reads["made"] += len(ids) > 8
        return real_root(ctx, ids, bound)

    def counting_make(chunks, tail, size, *args):
        reads["made"] += size > 8
        return real_make(chunks, tail, size, *args)

    def counting_ids(request):
        reads["ids"] += 1
        return real_ids.fget(request)

    for step in range(6):
        parents = [rng.randrange(n) for _ in range(n)] if step % 2 else list(range(n))  # resample every other step
        tokens = [rng.randrange(vocab) for _ in parents]
        grown = [contexts[p] + [t] if kind == "lists" else contexts[p].extend(t) for p, t in zip(parents, tokens)]
        requests = [ask(c) for c in grown]
        unique = list(dict.fromkeys(requests))
        watch(True)
        plan, released = index.plan(unique)
        for request, step_plan in zip(unique, plan, strict=True):
            if step_plan is not None:  # a fork starts a sequence of its own (a new handle), as live sequences do
                index.keep(request, next(handles) if step_plan.fork else step_plan.handle)
        watch(False)
        if step:  # the first step reads the prefixes of contexts that were made whole, once
            assert reads == {"made": 0, "ids": 0}, (step, reads)
        reads.update(made=0, ids=0)
        assert released == [] and all(p is not None for p in plan)
        for request, step_plan in zip(unique, plan, strict=True):
            assert step_plan is not None
            assert step_plan.new_tokens == request.token_ids[-len(step_plan.new_tokens) :]
            if not step_plan.fork:
                assert index.held(step_plan.handle) == request
            else:  # a sibling: the handle continued first held its parent's context
                sibling = next(
                    r for r, q in zip(unique, plan) if q is not None and not q.fork and q.handle == step_plan.handle
                )
                assert sibling.token_ids[: len(request) - 1] == request.token_ids[:-1]
        contexts = grown
