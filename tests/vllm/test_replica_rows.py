"""A replica's rows on their way to the client: a request that failed alone in the replica fails alone here."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core import Failed, Request
from genlm_vllm.drivers.replicas import ReplicaEngine, ReplicaError, pack_rows, unpack_rows


class RowsDriver:
    """What a replica's LLMDriver returns for a share: a row per request, a Failed for ``failing`` ones."""

    def __init__(self, failing: set[tuple[int, ...]]):
        self.lock = threading.RLock()
        self.failing = failing

    def logits(self, requests: list[Request]) -> list[torch.Tensor | Failed]:
        return [
            Failed(RuntimeError(f"vLLM ended request {list(r.token_ids)} early"))
            if r.token_ids in self.failing
            else torch.arange(5, dtype=torch.float32) * sum(r.token_ids)
            for r in requests
        ]


def replica(failing: set[tuple[int, ...]]) -> ReplicaEngine:
    engine = ReplicaEngine.__new__(ReplicaEngine)  # (no engine: the driver is a stand-in)
    engine.driver = RowsDriver(failing)  # type: ignore[assignment]
    return engine


def test_a_request_that_failed_in_a_replica_fails_alone_and_the_others_rows_arrive_exact():
    contexts = [[1, 2], [3], [4, 5, 6]]
    sent = replica({(3,)}).logits(contexts, [None, None, None])
    rows = unpack_rows(*sent, len(contexts), "replica 1 of 2")
    assert isinstance(rows[1], Failed) and isinstance(rows[1].error, ReplicaError)
    assert "replica 1 of 2" in str(rows[1].error) and "ended request [3] early" in str(rows[1].error)
    for i in (0, 2):
        assert torch.equal(rows[i], torch.arange(5, dtype=torch.float32) * sum(contexts[i]))


def test_a_share_whose_every_request_failed_and_one_that_failed_none():
    rows = unpack_rows(*replica({(1,), (2,)}).logits([[1], [2]], [None, None]), 2, "replica 0 of 2")
    assert all(isinstance(r, Failed) and "replica 0 of 2" in str(r.error) for r in rows)
    block = torch.randn(3, 7, dtype=torch.float64)
    rows = unpack_rows(*pack_rows(block), 3, "replica 0 of 2")
    assert torch.equal(torch.stack(rows), block.to(torch.float32))  # type: ignore[arg-type]
