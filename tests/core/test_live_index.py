"""The live index: one owner of what each live sequence holds, checked against a plain model of it."""

from __future__ import annotations

import random

import pytest

from genlm_core import Request
from genlm_core.live_index import LiveIndex


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(4))
def test_random_keeps_forgets_evictions_and_plans_agree_with_a_plain_model(seed: int) -> None:
    """Random operations on the index and on a plain list of (handle, context) in the order kept;
    after each, every public read of the index agrees with the list, and every prefix it offers is
    held by the handle it names (a forgotten handle is never offered)."""
    rng = random.Random(seed)
    lookback = rng.choice([1, 2, 3])
    index: LiveIndex[int] = LiveIndex(lookback, arrays=True)
    model: list[tuple[int, Request]] = []  # live sequences, kept longest ago first
    names = iter(range(10**6))

    def random_context() -> Request:
        if model and rng.random() < 0.7:  # near a live one: extend, cut back, or branch
            base = rng.choice(model)[1].token_ids
            base = base[: rng.randint(1, len(base))]
            return Request(
                base + tuple(rng.randrange(4) for _ in range(rng.randint(0, 3))), rng.choice([None, None, "a"])
            )
        return Request(tuple(rng.randrange(4) for _ in range(rng.randint(1, 6))))

    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            context, handle = random_context(), next(names)
            before = [h for h, c in model if c == context]
            assert index.keep(context, handle) == (before[0] if before else None)
            model = [(h, c) for h, c in model if c != context] + [(handle, context)]
        elif op < 0.6 and model:
            handle = rng.choice(model)[0]
            index.forget([handle])
            model = [(h, c) for h, c in model if h != handle]
        elif op < 0.7:
            assert index.evict() == (model.pop(0) if model else None)
        elif op < 0.8 and model:  # a batch: plan, then keep what it continued with its new context
            requests = list(dict.fromkeys(random_context() for _ in range(rng.randint(1, 4))))
            plan, released = index.plan(requests)
            assert released == []
            claimed = {c.handle for c in plan if c is not None and not c.fork}
            assert len(index) == len(model) - len(claimed)
            for request, continuation in zip(requests, plan, strict=True):
                if continuation is not None:
                    held = index.held(continuation.handle)
                    assert held is not None and held.adapter == request.adapter
                    assert held.token_ids + continuation.new_tokens == request.token_ids
                    assert 1 <= len(continuation.new_tokens) <= lookback
            model = [(h, c) for h, c in model if h not in claimed]
            for request, continuation in zip(requests, plan, strict=True):
                if continuation is not None and not continuation.fork:
                    index.keep(request, continuation.handle)
                    model = [(h, c) for h, c in model if c != request] + [(continuation.handle, request)]
        assert [c for _, c in model] == index.contexts()
        assert [(c, h) for h, c in model] == index.items()
        assert len(index) == len(model) and index.live_tokens() == sum(len(c) for _, c in model)
        for handle, context in model:
            assert index.held(handle) == context
        probe = random_context()
        found = index.longest_prefix(probe)
        best = max(
            (common(c.token_ids, probe.token_ids[:-1]) for _, c in model if c.adapter == probe.adapter), default=0
        )
        if found is None:
            assert best == 0
        else:
            handle, length = found
            assert handle in {h for h, _ in model}, "offered a handle that is not live"
            held = index.held(handle)
            assert held is not None and held.adapter == probe.adapter
            assert 1 <= length <= len(probe) - 1 and held.token_ids[:length] == probe.token_ids[:length]
        assert index.extends_live(probe) == any(
            c.adapter == probe.adapter
            and 1 <= len(probe) - len(c) <= lookback
            and probe.token_ids[: len(c)] == c.token_ids
            for _, c in model
        )
    assert sorted(index.release_all()) == sorted(h for h, _ in model)
    assert len(index) == 0 and index.contexts() == [] and index.longest_prefix(Request((1, 2, 3))) is None


def test_a_claimed_sequence_is_held_but_not_live_until_kept_or_forgotten() -> None:
    index: LiveIndex[str] = LiveIndex(lookback=1)
    index.keep(Request((1, 2)), "a")
    plan, _ = index.plan([Request((1, 2, 3))])
    assert plan[0] is not None and plan[0].handle == "a"
    assert len(index) == 0 and index.held("a") == Request((1, 2))  # claimed: its old context until kept
    assert index.longest_prefix(Request((1, 3))) == ("a", 1)  # a request may still copy its prefix
    index.forget(["a"])
    assert index.held("a") is None and index.longest_prefix(Request((1, 3))) is None
    assert index.release_all() == []
