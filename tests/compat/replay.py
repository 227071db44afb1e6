"""Record the rows a client program received from one LM, and hand exactly those rows to the same program
run on another LM.

A client program (genlm-control's SMC, a llamppl model, genlm-bytes' beam) is a deterministic function of
its seeds and of the rows it is given. Comparing its outputs on genlm and on genlm-backend directly would
need a bound on how far each output moves when every row moves by the two float32 passes' difference,
which depends on the program's internals (AWRS's ``log1p(-rejected mass)`` has no bounded sensitivity).
So the comparison is split in two, each with a tolerance that says where it comes from:

- the rows genlm served are genlm-backend's rows of the same contexts within
  :func:`genlm_core.testing.bounds.model_difference` (two float32 passes of one model);
- the program run on genlm-backend with genlm's rows replayed gives genlm's outputs exactly (same code,
  same seeds, same inputs: every bit equal), or within the bound of whatever the two sides compute
  differently themselves (genlm-bytes' float32 trie sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

#: The row methods a client program calls, in the order :func:`_install` takes their replacements.
ROW_METHODS = (
    "next_token_logprobs",
    "batch_next_token_logprobs",
    "next_token_logprobs_sync",
    "batch_next_token_logprobs_sync",
)


def _install(lm: Any, monkeypatch: pytest.MonkeyPatch, methods: tuple[Any, ...]) -> None:
    """Put ``methods`` (one per name of :data:`ROW_METHODS`, in its order) on the instance ``lm``."""
    for name, fn in zip(ROW_METHODS, methods, strict=True):
        monkeypatch.setattr(lm, name, fn)


def _key(context: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in context)


class Recorder:
    """Wraps ``lm``'s row methods (on the instance, through ``monkeypatch``) to keep a copy of every row
    handed out, by its exact context; a context served twice must get the same row both times."""

    def __init__(self, lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        single, batch = lm.next_token_logprobs, lm.batch_next_token_logprobs
        single_sync, batch_sync = lm.next_token_logprobs_sync, lm.batch_next_token_logprobs_sync

        async def next_token_logprobs(token_ids: Sequence[int], *args: Any, **kw: Any) -> torch.Tensor:
            return self._keep([token_ids], [await single(token_ids, *args, **kw)])[0]

        async def batch_next_token_logprobs(token_ids_list: Sequence[Sequence[int]], *args: Any, **kw: Any) -> Any:
            rows = await batch(token_ids_list, *args, **kw)
            self._keep(token_ids_list, rows)
            return rows

        def next_token_logprobs_sync(token_ids: Sequence[int], *args: Any, **kw: Any) -> torch.Tensor:
            return self._keep([token_ids], [single_sync(token_ids, *args, **kw)])[0]

        def batch_next_token_logprobs_sync(token_ids_list: Sequence[Sequence[int]], *args: Any, **kw: Any) -> Any:
            rows = batch_sync(token_ids_list, *args, **kw)
            self._keep(token_ids_list, rows)
            return rows

        _install(
            lm,
            monkeypatch,
            (next_token_logprobs, batch_next_token_logprobs, next_token_logprobs_sync, batch_next_token_logprobs_sync),
        )

    def _keep(self, contexts: Sequence[Sequence[int]], rows: Any) -> Any:
        for context, row in zip(contexts, rows, strict=True):
            key, copy = _key(context), row.detach().to("cpu", copy=True)
            if key in self.rows:
                assert torch.equal(self.rows[key], copy), f"two different rows for {key}"
            else:
                self.rows[key] = copy
        return rows


def replay(lm: Any, rows: dict[tuple[int, ...], torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Make ``lm``'s row methods return a fresh copy of ``rows[context]``; a context not recorded fails
    (the program took another path). Returns the list of contexts asked, in order."""
    asked: list[tuple] = []

    def row(context: Sequence[int]) -> torch.Tensor:
        key = _key(context)
        asked.append(key)
        assert key in rows, f"the replayed program asked for a context the recorded run never did: {key}"
        return rows[key].clone()

    async def next_token_logprobs(token_ids: Sequence[int], *args: Any, **kw: Any) -> torch.Tensor:
        return row(token_ids)

    async def batch_next_token_logprobs(token_ids_list: Sequence[Sequence[int]], *args: Any, **kw: Any) -> Any:
        return torch.stack([row(c) for c in token_ids_list])

    def next_token_logprobs_sync(token_ids: Sequence[int], *args: Any, **kw: Any) -> torch.Tensor:
        return row(token_ids)

    def batch_next_token_logprobs_sync(token_ids_list: Sequence[Sequence[int]], *args: Any, **kw: Any) -> Any:
        return torch.stack([row(c) for c in token_ids_list])

    _install(
        lm,
        monkeypatch,
        (next_token_logprobs, batch_next_token_logprobs, next_token_logprobs_sync, batch_next_token_logprobs_sync),
    )
    return asked
