"""``AsyncVirtualLM`` runs core's request path unchanged: only its driver differs, and it overrides none of it.

A driver with no engine behind it (:class:`TableDriver`) gives each context seeded logits; the rows the
LM hands out are checked against ``torch.log_softmax`` of those logits, computed here. Nothing here
imports vLLM.
"""

from __future__ import annotations

import asyncio
import gc
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from genlm_core import AsyncLM, Failed, Request
from genlm_core.testing.tokenizers import toy_tokenizer
from genlm_vllm.drivers.base import EngineDriver
from genlm_vllm.layout import Layout, layout
from genlm_vllm.lm import AsyncVirtualLM
from genlm_vllm.options import VLLMOptions
from genlm_vllm.transport.channels import LocalRows

PADDING = 7  #: columns past the vocabulary, as a model's padded vocabulary has


def raw_row(token_ids: Sequence[int], width: int) -> torch.Tensor:
    """The logits :class:`TableDriver` gives a context: seeded by the context alone."""
    seed = zlib.crc32(repr(tuple(token_ids)).encode())
    return 4 * torch.randn(width, generator=torch.Generator().manual_seed(seed))


class TableDriver(EngineDriver):
    """An engine driver without an engine. Contexts in :attr:`failing` fail alone (as a replica's do);
    with a row channel (``normalising``), rows come back normalised, as the capture processor does."""

    def __init__(self, width: int, streams: bool = False, normalising: bool = False):
        options = VLLMOptions()
        super().__init__(layout(options), options)
        self.width = width
        self.streams = streams
        self.rows = LocalRows() if normalising else None
        self.failing: set[tuple[int, ...]] = set()
        self.batched: list[list[tuple[int, ...]]] = []
        self.streamed: list[tuple[int, ...]] = []

    @classmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> TableDriver:
        raise NotImplementedError

    def _row(self, request: Request) -> torch.Tensor:
        row = raw_row(request.token_ids, self.width)
        if self.rows is not None and self.rows.vocab_size is not None:
            row = torch.log_softmax(row[: self.rows.vocab_size], dim=-1)
        return row

    def logits(self, requests: Sequence[Request]) -> list[torch.Tensor | Failed]:
        self.batched.append([r.token_ids for r in requests])
        return [
            Failed(RuntimeError(f"replica 1 failed on {list(r.token_ids)}"))
            if r.token_ids in self.failing
            else self._row(r)
            for r in requests
        ]

    async def stream_logits(self, request: Request) -> torch.Tensor:
        self.streamed.append(request.token_ids)
        await asyncio.sleep(0)
        return self._row(request)

    def uncached_logits(self, request: Request) -> torch.Tensor:
        return self._row(request)

    def run(self, calls: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def engine_call(self, op: str, *args: Any) -> list[Any]:
        if op != "reset_prefix_cache":
            raise NotImplementedError
        return [None]

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return toy_tokenizer()


def model(tokenizer: Any, **driver: Any) -> tuple[AsyncVirtualLM, TableDriver]:
    width = len(tokenizer) + PADDING
    table = TableDriver(width, **driver)
    return AsyncVirtualLM(table, tokenizer, VLLMOptions(batch_size=16, timeout=0.01)), table


def reference(lm: AsyncLM, token_ids: Sequence[int]) -> torch.Tensor:
    return torch.log_softmax(raw_row(token_ids, lm.vocab_size + PADDING)[: lm.vocab_size], dim=-1)


def full_collections(action: Callable[[], object]) -> int:
    """How many full garbage-collection passes ``action`` runs (automatic ones held off meanwhile)."""
    count = 0

    def seen(phase: str, info: dict[str, int]) -> None:
        nonlocal count
        count += phase == "start" and info["generation"] == 2

    enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(seen)
    try:
        action()
    finally:
        gc.callbacks.remove(seen)
        if enabled:
            gc.enable()
    return count


def test_cleanup_collects_once_and_a_driver_closed_alone_collects_itself(tokenizer):
    """A full pass takes about 0.5 s in a process that imported vLLM: ``cleanup()`` runs one, after the
    driver's close, which leaves it to cleanup; a driver closed on its own (a failed start) runs its own,
    so that this process unmaps the engine's queues then."""
    lm, table = model(tokenizer)
    assert full_collections(lm.cleanup) == 1
    assert table._closed
    _, alone = model(tokenizer)
    assert full_collections(alone.close) == 1
    assert alone._closed


def test_the_lm_overrides_nothing_of_cores_request_path():
    own = vars(AsyncVirtualLM)
    for name in ("request_logprobs", "compute_rows", "finish_rows", "next_token_logprobs", "_rows_sync"):
        assert name not in own, name


@pytest.mark.parametrize("normalising", [False, True])
async def test_a_failed_row_fails_its_request_alone(tokenizer, normalising):
    lm, table = model(tokenizer, normalising=normalising)
    try:
        assert lm.rows_normalised is normalising and not lm.streams
        contexts = [[5, 6], [7], [8, 9, 10]]
        table.failing.add((7,))
        got = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts), return_exceptions=True)
        assert len(table.batched) == 1 and len(table.batched[0]) == 3  # one batch, as the batcher made it
        assert isinstance(got[1], RuntimeError) and "replica 1 failed on [7]" in str(got[1])
        for context, row in ((contexts[0], got[0]), (contexts[2], got[2])):
            assert isinstance(row, torch.Tensor) and row.shape == (lm.vocab_size,)
            torch.testing.assert_close(row, reference(lm, context))
        table.failing.clear()  # the failed request was not cached: asked again, it is computed
        torch.testing.assert_close(await lm.next_token_logprobs([7]), reference(lm, [7]))
        torch.testing.assert_close(lm.next_token_logprobs_sync([11, 12]), reference(lm, [11, 12]))
    finally:
        lm.cleanup()


async def test_a_streaming_driver_bypasses_the_batcher(tokenizer):
    lm, table = model(tokenizer, streams=True, normalising=True)
    try:
        assert lm.streams and lm.rows_normalised
        contexts = [[1, 2, 3], [4], [1, 2, 3]]
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for context, row in zip(contexts, rows, strict=True):
            torch.testing.assert_close(row, reference(lm, context))
        assert table.batched == [] and sorted(set(table.streamed)) == [(1, 2, 3), (4,)]
        before = len(table.streamed)
        torch.testing.assert_close(await lm.next_token_logprobs([4]), reference(lm, [4]))  # the output cache
        assert len(table.streamed) == before
    finally:
        lm.cleanup()
