"""The caller's side of row capture: how rows written inside the engine come back to genlm.

Three channels, one per place the logits processor (:mod:`genlm_vllm.in_engine.capture`) can run:

- :class:`LocalRows`: the engine runs in this process; each batch's rows come back in the inbox its
  call opened (:data:`~genlm_vllm.transport.mailbox.INBOX`).
- :class:`SharedMemoryRows`: the processor runs in other processes on this host; each request gets a
  slot in a ``/dev/shm`` file that this object owns, creates, and removes on :meth:`close` (also at
  interpreter exit, and whatever happened to the engine).
- :class:`RpcRows`: the processor may run on other hosts; rows come back through vLLM's
  ``collective_rpc`` as raw bytes, merged by tag.

Every channel hands out a :class:`Ticket` (tags, and the ``extra_args`` that carry them into the
engine: :mod:`genlm_vllm.transport.keys`) before the requests are submitted, and returns one row or ``None``
(missing) per request afterwards. A row is only ever matched by its own tag or sequence number, never
by position. :func:`stack` makes a batch's rows one tensor, without a copy where they already are one
block. Nothing here imports vLLM.
"""

from __future__ import annotations

import abc
import itertools
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from genlm_core import Request
from genlm_core.rows import rows_block
from genlm_vllm.transport import mailbox
from genlm_vllm.transport.keys import NORMALISE, ON_DEVICE, SLOT, TAG
from genlm_vllm.transport.shm import FILE_PREFIX, SHM_DIR, Segment, remove_files, remove_files_of_dead_processes

log = logging.getLogger(__name__)


@dataclass
class Ticket:
    """What a batch of requests carries into the engine, and how to find their rows afterwards."""

    tags: list[str]
    extra_args: list[dict[str, Any]]
    slots: list[tuple[Segment, int, int]] = field(default_factory=list)  # (segment, index, sequence number)
    inbox: dict[str, torch.Tensor] = field(default_factory=dict)  #: where an in-process engine puts rows (LocalRows)
    opened: Any = None  #: the inbox's ContextVar token while it is open (LocalRows)


class RowChannel(abc.ABC):
    """Brings captured rows back to the caller."""

    name: str

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:12]
        self._count = itertools.count()
        #: The caller's vocabulary size: rows are normalised over that many first columns inside the
        #: engine (None: rows come back as raw logits).
        self.vocab_size: int | None = None
        #: Rows stay on the model's device (an in-process engine on an accelerator).
        self.on_device = False

    def new_tags(self, n: int) -> list[str]:
        """``n`` tags never handed out before (also usable as vLLM request ids)."""
        return [f"{self._prefix}-{next(self._count)}" for _ in range(n)]

    def prepare(self, n: int) -> Ticket:
        """Tags (and slots) for ``n`` requests about to be submitted."""
        tags = self.new_tags(n)
        extra: dict[str, Any] = {}
        if self.vocab_size is not None:
            extra[NORMALISE] = self.vocab_size
        if self.on_device:
            extra[ON_DEVICE] = True
        return Ticket(tags, [{TAG: tag, **extra} for tag in tags])

    @abc.abstractmethod
    def collect(self, ticket: Ticket) -> list[torch.Tensor | None]:
        """The rows of a ticket whose requests have finished, in order; None where a row is missing."""

    async def collect_async(self, ticket: Ticket) -> list[torch.Tensor | None]:
        return self.collect(ticket)

    def release(self, ticket: Ticket, finished: bool = True) -> None:  # noqa: B027 - nothing held by default
        """Free what the ticket holds. ``finished=False``: its requests failed or were aborted, and
        one of them might still be running in the engine."""

    def close(self) -> None:  # noqa: B027 - nothing held by default
        """Free everything this channel holds."""


class LocalRows(RowChannel):
    """The engine runs in this process: a batch opens an inbox in the caller's thread
    (:data:`~genlm_vllm.transport.mailbox.INBOX`, until :meth:`release`), the engine steps in that
    thread, and the capture processor puts each row there. A row written in another thread (an engine
    that ran its model in a thread of its own) is taken from the mailbox by its tag instead."""

    name = "local"

    def prepare(self, n: int) -> Ticket:
        ticket = super().prepare(n)
        ticket.opened = mailbox.INBOX.set(ticket.inbox)
        return ticket

    def collect(self, ticket: Ticket) -> list[torch.Tensor | None]:
        rows = [ticket.inbox.get(tag) for tag in ticket.tags]
        missing = [tag for tag, row in zip(ticket.tags, rows, strict=True) if row is None]
        if missing:
            found = dict(mailbox.take(missing))
            rows = [found.get(tag) if row is None else row for tag, row in zip(ticket.tags, rows, strict=True)]
        return rows

    def release(self, ticket: Ticket, finished: bool = True) -> None:
        if ticket.opened is not None:
            mailbox.INBOX.reset(ticket.opened)
            ticket.opened = None
        if not finished:
            mailbox.drop(ticket.tags)


class SharedMemoryRows(RowChannel):
    """Slots in ``/dev/shm`` files owned by this process; the engine's writing rank fills them.

    Slots are handed out under a lock, so concurrent batches never share one; the pool grows by
    one file of ``slots_per_file`` slots when it runs out. Each slot carries a flag: the writer sets
    it to -1, copies the row, then sets it to the request's sequence number, and a row is accepted
    only if the flag holds that number both before and after it is read. A slot whose request may
    still be running (a failed batch) is never handed out again.
    """

    name = "shm"

    def __init__(self, width: int, slots_per_file: int = 256, directory: str = SHM_DIR):
        super().__init__()
        self.width, self.slots_per_file, self.directory = width, slots_per_file, directory
        self.segments: list[Segment] = []
        self.paths: list[str] = []
        self._free: list[tuple[Segment, int]] = []
        self.retired = 0  #: slots never handed out again (their request may still be running)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._remove = weakref.finalize(self, remove_files, self.paths)  # also runs at interpreter exit
        remove_files_of_dead_processes(directory)

    def _grow(self) -> None:
        path = os.path.join(self.directory, f"{FILE_PREFIX}{os.getpid()}-{self._prefix}-{len(self.segments)}")
        self.paths.append(path)
        segment = Segment(path, self.slots_per_file, self.width, create=True)
        self.segments.append(segment)
        self._free.extend((segment, i) for i in reversed(range(segment.n)))

    def prepare(self, n: int) -> Ticket:
        ticket = super().prepare(n)
        with self._lock:
            if not self._remove.alive:
                raise RuntimeError("this row channel is closed")
            while len(self._free) < n:
                self._grow()
            taken = [self._free.pop() for _ in range(n)]
            for args, (segment, index) in zip(ticket.extra_args, taken):
                seq = next(self._seq)
                segment.flags[index] = 0
                args[SLOT] = [segment.path, segment.n, segment.width, index, seq]
                ticket.slots.append((segment, index, seq))
        return ticket

    def collect(self, ticket: Ticket) -> list[torch.Tensor | None]:
        """The slots' rows, copied once into one block (views of it); a slot whose flag is not the
        request's number both before and after the copy gives None."""
        before = [int(segment.flags[index]) for segment, index, _ in ticket.slots]
        block = torch.stack([segment.data[index] for segment, index, _ in ticket.slots]) if ticket.slots else None
        rows: list[torch.Tensor | None] = []
        for i, ((segment, index, seq), flag) in enumerate(zip(ticket.slots, before, strict=True)):
            assert block is not None
            ok = flag == seq and int(segment.flags[index]) == seq
            rows.append(block[i] if ok else None)
        return rows

    def release(self, ticket: Ticket, finished: bool = True) -> None:
        with self._lock:
            if finished:
                self._free.extend((segment, index) for segment, index, _ in ticket.slots)
            else:
                self.retired += len(ticket.slots)
                log.debug("genlm-vllm: %d slots retired after a failed batch", len(ticket.slots))

    @property
    def in_use(self) -> int:
        """Slots handed out and not yet released (retired ones not counted)."""
        with self._lock:
            return sum(s.n for s in self.segments) - len(self._free) - self.retired

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self.segments.clear()
            self._remove()


PopRows = Callable[[list[str], list[str]], list[Any]]


class RpcRows(RowChannel):
    """Rows stay on the writing rank until fetched with ``collective_rpc("genlm_pop_rows")``.

    ``pop(tags, discard)`` runs the RPC on every worker (synchronously, or awaited for the async
    engine) and returns their replies; only the writing rank answers with rows. Rows of failed
    batches are dropped on the workers with the next fetch.
    """

    name = "rpc"

    def __init__(self, pop: PopRows | None = None, pop_async: Callable[..., Awaitable[list[Any]]] | None = None):
        super().__init__()
        self.pop, self.pop_async = pop, pop_async
        self._discard: list[str] = []
        self._lock = threading.Lock()

    def _take_discard(self) -> list[str]:
        with self._lock:
            discard, self._discard = self._discard, []
        return discard

    @staticmethod
    def _merge(tags: list[str], replies: list[Any]) -> list[torch.Tensor | None]:
        found: dict[str, torch.Tensor] = {}
        for reply in replies:
            if reply is None:
                continue
            got, width, raw = reply
            if got:
                rows = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(len(got), width)
                found.update(zip(got, rows))
        return [found.get(tag) for tag in tags]

    def collect(self, ticket: Ticket) -> list[torch.Tensor | None]:
        if self.pop is None:
            raise RuntimeError("this engine fetches rows asynchronously")
        return self._merge(ticket.tags, self.pop(ticket.tags, self._take_discard()))

    async def collect_async(self, ticket: Ticket) -> list[torch.Tensor | None]:
        if self.pop_async is None:
            return self.collect(ticket)
        return self._merge(ticket.tags, await self.pop_async(ticket.tags, self._take_discard()))

    def release(self, ticket: Ticket, finished: bool = True) -> None:
        if not finished:
            with self._lock:
                self._discard.extend(ticket.tags)

    def close(self) -> None:
        self.pop = self.pop_async = None  # they hold the engine (and, with Ray, its mapped queues)


def open_channel(
    capture: str,
    width: int,
    pop: PopRows | None = None,
    pop_async: Callable[..., Awaitable[list[Any]]] | None = None,
) -> RowChannel:
    """The channel that reaches where an engine's model runs, by its layout's ``capture`` ("local",
    "shm" or "rpc": :attr:`~genlm_vllm.layout.Layout.capture`); the one place a channel is
    chosen. ``width``: the logits row's length; ``pop``/``pop_async``: the engine's
    ``collective_rpc("genlm_pop_rows", ...)``, for rows on other hosts."""
    if capture == "local":
        return LocalRows()  # (on_device is set by the driver where options ask)
    if capture == "shm":
        return SharedMemoryRows(width)
    return RpcRows(pop, pop_async)


def stack(rows: Sequence[torch.Tensor | None], requests: Sequence[Request]) -> torch.Tensor:
    """The rows of a batch as one tensor; a missing row fails the batch, naming the request."""
    missing = [i for i, row in enumerate(rows) if row is None]
    if missing:
        first = requests[missing[0]].token_ids
        raise RuntimeError(
            f"vLLM returned no logits for {len(missing)} of {len(rows)} requests (the first: a context of "
            f"{len(first)} tokens ending {list(first[-5:])})"
        )
    return rows_block(rows)  # type: ignore[arg-type]
