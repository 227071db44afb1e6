"""What a process that multiprocessing starts runs in ``test_rows.py``'s marking test: kept apart from the
test module so that a spawned child imports only this (not vLLM)."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import shared_memory
from typing import Any


def names_made_here(queue: Any, caller: int) -> None:
    """Make a semaphore and a segment, and (in the child of process ``caller``) a child that does too; report
    the names."""
    lock = mp.get_context("spawn").Lock()
    segment = shared_memory.SharedMemory(create=True, size=16)
    queue.put([os.getpid(), lock._semlock.name, segment.name])  # type: ignore[attr-defined]
    parent = mp.parent_process()
    if parent is not None and parent.pid == caller:
        child = mp.get_context("spawn").Process(target=names_made_here, args=(queue, caller))
        child.start()
        child.join(60)
    segment.close()
    segment.unlink()
