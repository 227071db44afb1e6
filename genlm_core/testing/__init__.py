"""Helpers for testing genlm and genlm plugins: fake-plugin registration and a protocol check."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from genlm_core.lm import AsyncLM
from genlm_core.plugins import get_plugins
from genlm_core.testing import bounds

_unnamed = itertools.count(1)


@contextlib.contextmanager
def registered(plugin: Any, name: str | None = None) -> Iterator[Any]:
    """Register ``plugin`` (an object with ``@hookimpl`` methods) for the duration of a block,
    as ``name`` (default: its class or module name and a number)."""
    plugins = get_plugins()
    if name is None:
        name = f"{getattr(plugin, '__name__', None) or type(plugin).__name__}-{next(_unnamed)}"
    plugins.register(plugin, name)
    try:
        yield plugin
    finally:
        plugins.unregister(plugin)


def concurrent_logprobs(lm: AsyncLM, contexts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """``next_token_logprobs`` of every context, issued concurrently (so the backend batches them)."""

    async def gather() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts)))

    return asyncio.run(gather())


def max_abs_diff(rows: torch.Tensor | Sequence[torch.Tensor], others: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Largest absolute difference, in float64, between two rows (1-D tensors) or between two batches of
    rows (2-D tensors or sequences of rows) paired in order. Shapes and counts must match: a ValueError
    says where they do not (no broadcasting, no pairs silently dropped)."""
    if isinstance(rows, torch.Tensor) and isinstance(others, torch.Tensor):
        if rows.shape != others.shape:
            raise ValueError(f"shapes differ: {tuple(rows.shape)} and {tuple(others.shape)}")
        if rows.numel() == 0:
            raise ValueError("no values to compare")
        return (rows.double() - others.double()).abs().max().item()
    rows, others = list(rows), list(others)
    if len(rows) != len(others):
        raise ValueError(f"{len(rows)} rows against {len(others)}")
    if not rows:
        raise ValueError("no rows to compare")
    return max(max_abs_diff(a, b) for a, b in zip(rows, others))


def check_lm_contract(
    lm: AsyncLM,
    contexts: Sequence[Sequence[int]],
    atol: bounds.Tolerance = None,
    bad_input: bool = True,
    close: bool = False,
) -> None:
    """Assert the whole AsyncLM protocol on ``contexts``; raises AssertionError naming what broke.

    - rows: 1-D float32 of length ``len(byte_vocab)``, normalised (within
      :func:`~genlm_core.testing.bounds.normalisation_error`); the sync, sync-batched, async-batched and
      concurrent paths agree within ``atol``, and concurrent requests are batched. ``atol`` is a number,
      a function of the contexts (:func:`genlm_core.testing.bounds.rows_bound` for an engine whose
      matrix products change with the batch), or ``None``: two log-softmaxes of the same logits
      (:func:`genlm_core.testing.bounds.resolve`);
    - the output cache: a repeated request is answered from it, and equally after ``clear_cache``;
    - sampling: greedy follows the argmax, a seed reproduces, ``max_tokens`` and EOS stop it, and
      ``batch_sample`` gives one valid continuation per prompt;
    - with ``bad_input``: bad contexts and sampling arguments raise TypeError/ValueError without a
      hang, cancelled requests do not disturb others, the model answers as before
      (:func:`genlm_core.testing.bad_input.check_rejects_bad_input`);
    - with ``close`` (it closes ``lm``): ``cleanup()`` twice is fine and every call afterwards raises
      :class:`~genlm_core.errors.ClosedError`.
    """
    lm.clear_cache()
    singles = [lm.next_token_logprobs_sync(c) for c in contexts]
    for c, row in zip(contexts, singles):
        assert row.dtype == torch.float32, f"dtype {row.dtype} for context {c}"
        assert row.shape == (len(lm.byte_vocab),), f"shape {tuple(row.shape)} != ({len(lm.byte_vocab)},)"
        total = torch.logsumexp(row.double(), 0).item()
        bounds.within("contract: normalised", abs(total), bounds.normalisation_error(row.numel()), f"context {c}")
    atol = bounds.resolve(atol, contexts, singles)
    lm.clear_cache()
    batched = lm.batch_next_token_logprobs_sync(contexts)

    async def concurrent() -> torch.Tensor:
        return await lm.batch_next_token_logprobs(contexts)

    lm.clear_cache()
    batches_before = lm.batcher.stats.batches
    gathered = asyncio.run(concurrent())
    distinct = len({tuple(c) for c in contexts})
    batches = lm.batcher.stats.batches - batches_before
    assert batches <= -(-distinct // lm.batcher.batch_size) + 1, (
        f"{distinct} concurrent requests took {batches} batches"
    )
    for name, rows in (("sync batch", batched), ("async batch", gathered)):
        for c, one, other in zip(contexts, singles, rows):
            assert torch.equal(one.isinf(), other.isinf()), f"{name}: -inf positions differ for context {c}"
            diff = bounds.row_difference(one, other)
            bounds.within(f"contract: {name} vs single", diff, atol, f"context {c}")
    check_output_cache(lm, contexts[0], atol)
    check_sampling(lm, contexts[0])
    if bad_input:
        from genlm_core.testing.bad_input import check_rejects_bad_input

        check_rejects_bad_input(lm, contexts[0], atol)
    if close:
        check_closed(lm, contexts[0])


def check_output_cache(lm: AsyncLM, context: Sequence[int], atol: bounds.Tolerance = None) -> None:
    """A repeated request is answered from the output cache without model work, and the row recomputed
    after ``clear_cache`` is the same within ``atol`` (:func:`genlm_core.testing.bounds.resolve`: the
    engine may compute it in another batch split)."""
    lm.clear_cache()
    first = lm.next_token_logprobs_sync(context)
    hits = lm.cache.hits
    again = asyncio.run(lm.next_token_logprobs(context))
    assert lm.cache.hits == hits + 1 and torch.equal(first, again), "a repeated request missed the output cache"
    lm.clear_cache()
    assert len(lm.cache) == 0, "clear_cache left entries"
    again = lm.next_token_logprobs_sync(context)
    assert torch.equal(again.isinf(), first.isinf()), "recomputed row: -inf positions differ"
    diff = bounds.row_difference(again, first)
    bounds.within("contract: recomputed vs cached", diff, bounds.resolve(atol, [context], [first]))


def check_sampling(lm: AsyncLM, prompt: Sequence[int]) -> None:
    """Greedy sampling follows the argmax; a seed reproduces; max_tokens and EOS stop sampling."""
    top = int(lm.next_token_logprobs_sync(prompt).argmax())
    greedy = asyncio.run(lm.sample(prompt, 3, [], temperature=0.0))
    assert len(greedy) == 3 and greedy[0] == top, f"greedy sample {greedy} does not start with the argmax {top}"
    assert asyncio.run(lm.sample(prompt, 3, [top], temperature=0.0)) == [], (
        "sampling did not stop at the EOS (unreturned)"
    )
    assert asyncio.run(lm.sample(prompt, 0, [])) == [], "max_tokens=0 sampled something"
    first = asyncio.run(lm.sample(prompt, 4, [], seed=1234))
    assert first == asyncio.run(lm.sample(prompt, 4, [], seed=1234)), "the same seed gave another sample"
    many = asyncio.run(lm.batch_sample([prompt, [*prompt, top]], 3, [], seed=7))
    assert len(many) == 2 and all(len(s) == 3 and all(0 <= t < lm.vocab_size for t in s) for s in many), many


def check_closed(lm: AsyncLM, context: Sequence[int]) -> None:
    """Close ``lm``: ``cleanup()`` twice is fine, and every call afterwards raises ClosedError."""
    from genlm_core.errors import ClosedError

    lm.cleanup()
    lm.cleanup()
    calls = {
        "next_token_logprobs_sync": lambda: lm.next_token_logprobs_sync(context),
        "next_token_logprobs": lambda: asyncio.run(lm.next_token_logprobs(context)),
        "batch_next_token_logprobs_sync": lambda: lm.batch_next_token_logprobs_sync([context]),
        "sample": lambda: asyncio.run(lm.sample(context, 1, [])),
        "clear_cache": lm.clear_cache,
    }
    for name, call in calls.items():
        try:
            call()
        except ClosedError:
            continue
        except Exception as exc:
            raise AssertionError(f"{name} after cleanup raised {type(exc).__name__}, not ClosedError") from exc
        raise AssertionError(f"{name} after cleanup still answered")
