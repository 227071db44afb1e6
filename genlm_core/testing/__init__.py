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


def max_abs_diff(rows: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference between paired logprob vectors (in float64)."""
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(rows, others))


def check_lm_contract(
    lm: AsyncLM, contexts: Sequence[Sequence[int]], atol: float = 1e-5, bad_input: bool = True
) -> None:
    """Assert the AsyncLM protocol contract on ``contexts``; raises AssertionError naming what broke.

    Each vector is 1-D float32 of length ``len(byte_vocab)`` and normalised; the async, sync,
    batched and concurrent paths agree within ``atol``. With ``bad_input``, bad contexts and
    sampling arguments must each raise TypeError/ValueError without a hang, cancelled requests
    must not disturb others, and the model must answer as before afterwards
    (:func:`genlm_core.testing.bad_input.check_rejects_bad_input`).
    """
    lm.clear_cache()
    singles = [lm.next_token_logprobs_sync(c) for c in contexts]
    for c, row in zip(contexts, singles):
        assert row.dtype == torch.float32, f"dtype {row.dtype} for context {c}"
        assert row.shape == (len(lm.byte_vocab),), f"shape {tuple(row.shape)} != ({len(lm.byte_vocab)},)"
        total = torch.logsumexp(row.double(), 0).item()
        assert abs(total) < 1e-4, f"logprobs of context {c} sum to exp({total})"
    lm.clear_cache()
    batched = lm.batch_next_token_logprobs_sync(contexts)

    async def concurrent() -> torch.Tensor:
        return await lm.batch_next_token_logprobs(contexts)

    lm.clear_cache()
    gathered = asyncio.run(concurrent())
    for name, rows in (("sync batch", batched), ("async batch", gathered)):
        for c, one, other in zip(contexts, singles, rows):
            diff = (one - other).abs().nan_to_num(0.0).max().item()
            assert diff <= atol, f"{name} differs from single by {diff} for context {c}"
            assert torch.equal(one.isinf(), other.isinf()), f"{name}: -inf positions differ for context {c}"
    if bad_input:
        from genlm_core.testing.bad_input import check_rejects_bad_input

        check_rejects_bad_input(lm, contexts[0], atol)
