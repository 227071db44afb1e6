"""The randomised check that an engine keeps particles alive correctly (core's :mod:`genlm_core.live`).

One particle program runs on any backend whose rows come from a :class:`~genlm_core.live.LiveSequences`:
particles continue their contexts, resample (siblings fork), go back to older contexts, repeat a context
the engine computed before, and cancel requests mid-flight. Every row served must equal the backend's
uncached row of the same context, and once the live sequences are released the engine must hold none.
A third party runs it on its own engine::

    from genlm_core.testing.live import check_live_sequences

    stats = check_live_sequences(lm, lm.sequences, in_use=lambda: len(engine.held))

The backend's ``forward_uncached`` is the reference, so it must not be the live path (see
:func:`check_reference`); an engine that implements
:meth:`~genlm_core.live.LiveEngine.evaluated_tokens` is also checked for copies that copy.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import torch

from genlm_core.live import LiveSequences, LiveStats
from genlm_core.lm import AsyncLM
from genlm_core.testing import bounds

Served = dict[tuple[int, ...], torch.Tensor]


async def particle_program(lm: AsyncLM, particles: int = 12, steps: int = 60, seed: int = 0) -> Served:
    """Every row served to a particle program that continues, forks, goes back, repeats and cancels."""
    rng = random.Random(seed)
    vocab = lm.vocab_size
    contexts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(particles)]
    served: Served = {}
    for step in range(steps):
        asked = [list(c) for c in contexts]
        if step % 9 == 4:  # a context computed before, asked again past the output cache
            lm.cache.clear()
            asked.append(list(rng.choice(list(served))))
        tasks = [asyncio.ensure_future(lm.next_token_logprobs(c)) for c in asked]
        cancelled = set(rng.sample(range(particles), 2)) if step % 7 == 3 else set()
        await asyncio.sleep(0)  # submitted: the batch is on its way
        for i in cancelled:
            tasks[i].cancel()
        rows = await asyncio.gather(*tasks, return_exceptions=True)
        for i, (context, row) in enumerate(zip(asked, rows, strict=True)):
            if isinstance(row, BaseException):
                if i in cancelled and isinstance(row, asyncio.CancelledError):
                    continue  # asks again next step
                raise row
            served[tuple(context)] = row
            if i < particles:
                draw = torch.Generator().manual_seed(seed * 100_003 + step * 97 + i)
                contexts[i].append(int(torch.multinomial(row.exp().double(), 1, generator=draw)))
        if step % 5 == 4:  # resample: siblings share a parent
            contexts = [list(contexts[rng.randrange(particles)]) for _ in range(particles)]
        if step % 11 == 6:  # one particle goes back to an older context
            c = contexts[rng.randrange(particles)]
            del c[max(1, len(c) - rng.randint(2, 6)) :]
    return served


def check_reference(lm: AsyncLM) -> None:
    """Raise TypeError when ``lm``'s reference row is its live path: ``forward_uncached`` left to
    AsyncLM's default, which runs ``forward_batch``. A live row checked against it cannot be wrong."""
    if type(lm).forward_uncached is AsyncLM.forward_uncached:
        raise TypeError(
            f"{type(lm).__name__}.forward_uncached is AsyncLM's default, which runs forward_batch: the live path "
            "itself, so it cannot tell a wrong live row from a right one. Override forward_uncached with a "
            "forward pass that does not use the live sequences (the model's plain forward, or "
            "LiveSequences.uncached: a fresh sequence computed from its first token)"
        )


def check_live_sequences(
    lm: AsyncLM,
    live: LiveSequences[Any, Any],
    in_use: Callable[[], int],
    *,
    particles: int = 12,
    steps: int = 60,
    seed: int = 0,
    atol: bounds.Tolerance = None,
) -> LiveStats:
    """Run :func:`particle_program` on ``lm`` and assert that

    - the stats of the program add up (``rows == continued + forked + copied + fresh``);
    - when the engine counts what its model evaluated (:meth:`~genlm_core.live.LiveEngine.evaluated_tokens`),
      that it equals the stats' ``tokens_computed``: a copy or a continuation that recomputes what it
      should have kept fails here, though its rows are right;
    - every row equals ``lm.next_token_logprobs_uncached`` of its context (within ``atol``: a number, a
      function of the served contexts such as :func:`genlm_core.testing.bounds.rows_bound`, or ``None``
      for two log-softmaxes of the same logits, :func:`genlm_core.testing.bounds.resolve`), a
      reference that must not be the live path: ``lm.forward_uncached`` left to AsyncLM's default is
      refused (TypeError, before anything runs), and one that runs the live sequences fails;
    - rows were continued, forked and computed fresh;
    - after ``live.release_all()`` the engine holds no sequence (``in_use()``: how many it holds).

    Returns the stats of the program alone (the reference rows count in none of them)."""
    check_reference(lm)
    engine = live.engine
    before, evaluated = _snapshot(live), engine.evaluated_tokens()
    served = asyncio.run(particle_program(lm, particles, steps, seed))
    with lm.model_lock:  # a batch whose every waiter was cancelled may still be running
        after, ran = _snapshot(live), engine.evaluated_tokens()
    stats = LiveStats(**{k: v - getattr(before, k) for k, v in after.as_dict().items()})
    placed = stats.continued + stats.forked + stats.copied + stats.fresh
    assert stats.rows == placed, (
        f"the stats do not add up: rows={stats.rows} but continued+forked+copied+fresh={placed}"
    )
    if evaluated is not None and ran is not None:
        assert ran - evaluated == stats.tokens_computed, (
            f"{type(engine).__name__} evaluated {ran - evaluated} positions but the stats count "
            f"{stats.tokens_computed} computed ({stats.tokens_copied} copied, {stats.tokens_cached} cached): a copy "
            "or a continuation recomputed positions the stats count as copied or held"
        )
    worst, where, references = 0.0, 0, []
    for context, row in served.items():
        reference = lm.next_token_logprobs_uncached(list(context))
        references.append(reference)
        gap = bounds.row_difference(row, reference)
        if not gap <= worst:  # NaN too
            worst, where = gap, len(context)
    touched = {k: getattr(live.stats, k) - getattr(after, k) for k in ("batches", "rows")}
    assert not any(touched.values()), (
        f"{type(lm).__name__}.forward_uncached ran the live sequences ({touched['batches']} batches, "
        f"{touched['rows']} rows): the reference must not be the live path"
    )
    tolerance = bounds.resolve(atol, [list(c) for c in served], references)
    bounds.within("live: served vs uncached", worst, tolerance, f"the row of a context of {where} tokens")
    assert stats.continued > 0 and stats.forked > 0 and stats.fresh > 0, f"a path never ran: {stats}"
    live.release_all()
    assert len(live) == 0 and in_use() == 0, f"{in_use()} sequences still held after release_all()"
    return stats


def _snapshot(live: LiveSequences[Any, Any]) -> LiveStats:
    return LiveStats(**live.stats.as_dict())
