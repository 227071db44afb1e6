"""Rows: a batch's logits made float32 logprobs in one pass, into memory reused across batches.

A step of a particle program turns ``[N, W]`` logits into N normalised rows. Done naively that is a
log-softmax into fresh memory, a pass to look for NaN and a copy of each row (so that rows can be
freed one by one). Here it is one ``log_softmax`` written straight into a block of rows that an
earlier batch used once nothing refers to it any more (fresh memory costs a page fault per 4 KiB
on the host, about as much as the log-softmax itself), and the NaN check reads one column: a NaN
or an infinity anywhere in a row's logits makes every entry of its log-softmax NaN.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch


class Failed:
    """A per-item failure a batch function may return in place of a result: a row that could not be
    computed (its request alone fails), or any batched item's."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


_use_count = getattr(torch._C, "_storage_Use_Count", None)


#: What :meth:`~genlm_core.lm.AsyncLM.forward_batch` returns: one block of rows, or one row (or a
#: :class:`Failed`) per request.
RowsOut = torch.Tensor | Sequence[torch.Tensor | Failed]


def storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors (views, numpy arrays, DLPack capsules, storages) hold ``tensor``'s memory,
    or None where torch does not say."""
    if _use_count is None:
        return None
    return int(_use_count(tensor.untyped_storage()._cdata)) - 1  # less the storage object made here


def normalise(
    logits: torch.Tensor,
    vocab_size: int,
    missing_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw logits ``[..., W]`` (any float dtype, ``W >= vocab_size``) to float32 logprobs
    ``[..., vocab_size]``, written into ``out`` when given (same device, float32, the result's shape).

    Columns past ``vocab_size`` (padded model vocabularies) are dropped before normalising; ids in
    ``missing_ids`` get ``-inf``. Each row sums to one in probability space, in float32.
    """
    if logits.shape[-1] < vocab_size:
        raise ValueError(f"model returned {logits.shape[-1]} logits, fewer than the vocabulary's {vocab_size}")
    x = logits[..., :vocab_size]
    if missing_ids is not None and len(missing_ids):
        x = x.to(torch.float32).index_fill(-1, missing_ids.to(x.device), float("-inf"))
    if out is None:
        return torch.log_softmax(x, dim=-1, dtype=torch.float32)
    if not x.is_contiguous() and out.is_contiguous():
        # padded columns dropped: log_softmax would copy the strided rows into fresh memory first (page
        # faults: 157 ms against 57 for [256, 131072] here); copied into ``out``, normalised in place
        out.copy_(x)
        return torch.log_softmax(out, dim=-1, out=out)
    return torch.log_softmax(x, dim=-1, dtype=torch.float32, out=out)


def nan_rows(logprobs: torch.Tensor) -> list[bool]:
    """Which rows of a log-softmax ``[N, V]`` hold NaN, from one column: a NaN or infinity anywhere in
    a row's logits (or a row of ``-inf`` only) makes every entry of its log-softmax NaN."""
    return torch.isnan(logprobs[:, 0]).tolist()


class RowMemory:
    """Blocks of host memory for batches of rows, each reused once nothing refers to it.

    :meth:`take` hands out ``[n, width]`` float32 rows: the start of a block that no row, view or
    array made from it holds any more (:func:`storage_users`), else a new block of the next power
    of two rows. A row handed out is never written again while anything holds it: that is what
    makes reuse safe. It looks at ``probe`` blocks per call, going round them (blocks come free in
    about the order they were filled, as the output cache evicts oldest first), and follows at most ``track``
    blocks: one beyond that is forgotten, freed by torch when its last row goes. Thread-safe. Memory on an
    accelerator is left to its framework's caching allocator (``take`` returns None there).
    """

    def __init__(self, track: int = 64, probe: int = 8):
        self.track, self.probe = track, probe
        self.reused = 0  #: blocks handed out again
        self.allocated = 0  #: blocks made
        self._blocks: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()  # two threads must never be handed one free block

    def take(self, n: int, width: int, device: torch.device) -> torch.Tensor | None:
        """Float32 memory for ``n`` rows of ``width`` on ``device`` (None: allocate as usual)."""
        if device.type != "cpu" or _use_count is None or n == 0:
            return None
        with self._lock:
            return self._take(n, width)

    def _take(self, n: int, width: int) -> torch.Tensor:
        capacity = 1 << (n - 1).bit_length()
        blocks = self._blocks
        for _ in range(min(self.probe, len(blocks))):
            block = blocks.popleft()
            blocks.append(block)  # looked at: to the back of the line, free or not
            if block.shape == (capacity, width) and storage_users(block) == 1:
                self.reused += 1
                return block[:n]
        block = torch.empty(capacity, width, dtype=torch.float32)
        self.allocated += 1
        blocks.append(block)
        while len(blocks) > self.track:
            blocks.popleft()
        return block[:n]

    def clear(self) -> None:
        """Forget every block (torch frees each once nothing else holds it)."""
        self._blocks.clear()


def rows_block(rows: Sequence[torch.Tensor], memory: RowMemory | None = None) -> torch.Tensor:
    """``rows`` (1-D, of one length) as one ``[len(rows), V]`` tensor: a view when they are rows,
    evenly spaced and in order, of one storage (a batch computed together), else a copy, written
    into a block of ``memory`` where given (host float32 rows: no page faults for a step's copy,
    as when a resampled batch names one row twice)."""
    if not rows:
        raise ValueError("rows_block needs at least one row")
    view = _as_view(rows)
    if view is not None:
        return view
    first = rows[0]
    out = None
    if memory is not None and first.dtype == torch.float32 and first.dim() == 1:
        out = memory.take(len(rows), first.shape[0], first.device)
    return torch.stack(list(rows)) if out is None else torch.stack(list(rows), out=out)


def _as_view(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The rows as one strided view of their storage, or None where they are not evenly spaced rows
    of one storage in order (of one shape, dtype and device, each contiguous)."""
    first = rows[0]
    if first.dim() != 1 or first.stride(0) != 1:
        return None
    size = first.element_size()
    gap = first.shape[0] * size if len(rows) == 1 else rows[1].data_ptr() - first.data_ptr()
    if gap % size or gap // size < first.shape[0]:
        return None
    ptr, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for i, row in enumerate(rows):
        if (
            row.dim() != 1
            or row.shape != first.shape
            or row.stride(0) != 1
            or row.dtype != first.dtype
            or row.device != first.device
            or row.data_ptr() != ptr + i * gap
            or row.untyped_storage().data_ptr() != storage
        ):
            return None
    return first.as_strided((len(rows), first.shape[0]), (gap // size, 1))
