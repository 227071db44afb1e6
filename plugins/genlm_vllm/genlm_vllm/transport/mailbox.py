"""Where the capture processor leaves a row that no shared-memory slot was given for, in the process
that writes it.

- **The inbox of the call that asked** (:data:`INBOX`): an in-process caller
  (:class:`~genlm_vllm.transport.channels.LocalRows`) opens one for a batch in its own thread, then
  steps the engine there; the processor (:mod:`genlm_vllm.in_engine.capture`), running inside that
  step, puts each row in it, so the row comes back up the call that asked for it.
- **Otherwise, by tag until taken** (:func:`keep`, :func:`take`): a worker process's rows, fetched
  through ``collective_rpc`` (:class:`~genlm_vllm.in_engine.capture.RowsExtension`), and rows written
  in a thread with no inbox open (an engine that ran its model in a thread of its own).

Either way a row is matched by its own request's tag. Imports no vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextvars import ContextVar

import torch

log = logging.getLogger(__name__)

#: The rows of the batch this thread's caller is running, by tag (None: no inbox open here).
INBOX: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("genlm_vllm_inbox", default=None)
#: Rows waiting to be taken, by tag; bounded by :data:`MAX_KEPT_ROWS`.
ROWS: dict[str, torch.Tensor] = {}
ROWS_LOCK = threading.Lock()
#: Rows kept for a caller that never takes them (a lost or aborted request) are dropped, oldest
#: first, beyond this many.
MAX_KEPT_ROWS = 8192


def keep(tag: str, row: torch.Tensor) -> None:
    """Leave ``row`` for the caller of request ``tag``."""
    with ROWS_LOCK:
        ROWS[tag] = row
        while len(ROWS) > MAX_KEPT_ROWS:
            dropped = next(iter(ROWS))
            del ROWS[dropped]
            log.warning("genlm-vllm: dropped the uncollected row of request %s", dropped)


def take(tags: Sequence[str], discard: Sequence[str] = ()) -> list[tuple[str, torch.Tensor]]:
    """Drop the rows of ``discard``, then take those of ``tags`` that are here: ``(tag, row)`` pairs."""
    with ROWS_LOCK:
        for tag in discard:
            ROWS.pop(tag, None)
        return [(tag, ROWS.pop(tag)) for tag in tags if tag in ROWS]


def drop(tags: Sequence[str]) -> None:
    """Forget the rows of ``tags`` (a failed batch's)."""
    with ROWS_LOCK:
        for tag in tags:
            ROWS.pop(tag, None)


def waiting() -> int:
    """How many rows wait to be taken."""
    with ROWS_LOCK:
        return len(ROWS)
