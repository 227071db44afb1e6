"""What crosses from the caller into vLLM's processes and back: names, keys and the slot file.

Both sides import this module: the caller (:mod:`genlm_vllm.rows`, :mod:`genlm_vllm.sessions`, the
engine arguments) and the engine's processes (:mod:`genlm_vllm.capture`, :mod:`genlm_vllm.forks`). It
imports neither vLLM nor anything that does, and does nothing at import.

- The ``extra_args`` keys a request carries into the engine (:data:`TAG`, :data:`SLOT`,
  :data:`CONTEXT`, :data:`NORMALISE`, :data:`ON_DEVICE`, :data:`FORK`, :data:`AT`).
- The names vLLM loads our engine-side code by, in each of its processes (:data:`PROCESSORS`,
  :data:`EXTENSION`, :data:`CONNECTOR` in :data:`CONNECTOR_MODULE`).
- What the engine's processes are set up with, in vLLM's ``additional_config`` (:data:`WORKER_NAP`).
- A context's fingerprint (:func:`context_fingerprint`), which the engine checks a request runs on.
- :class:`Segment`, the shared-memory file of row slots the caller owns and the engine writes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from genlm_core.context import Context

# ---- extra_args keys ------------------------------------------------------------------------------

TAG = "genlm_capture"  #: the request's tag (a string): its row is captured and matched by it
SLOT = "genlm_slot"  #: [segment path, slots in segment, width, slot index, sequence number]
CONTEXT = "genlm_context"  #: (optional) the :func:`context_fingerprint` the row must be for
NORMALISE = "genlm_normalise"  #: (optional) normalise the row over this many first columns
ON_DEVICE = "genlm_on_device"  #: (optional, in-process engines) keep the row on the model's device
FORK = "genlm_fork"  #: the request id of the live sequence whose context this one extends
#: (optional) how many output tokens a request holds when its row is computed: a resident request's
#: row after the tokens its program chose (:class:`~genlm_vllm.vllm_api.ResidentCore`); absent: 0, the
#: row at its prompt's last token
AT = "genlm_at"

# ---- the names vLLM loads our code by -------------------------------------------------------------

#: The capture processor for each model runner (their interfaces differ), as ``module:Class``.
PROCESSORS = {"v1": "genlm_vllm.capture:CaptureLogits", "v2": "genlm_vllm.capture:CaptureLogitsV2"}
#: Mixed into vLLM's workers (``worker_extension_cls``: vLLM wants a dotted path here).
EXTENSION = "genlm_vllm.capture.RowsExtension"
#: The KV connector that lets forks copy their parent's unfinished block (``kv_transfer_config``).
CONNECTOR = "ForkConnector"
CONNECTOR_MODULE = "genlm_vllm.forks"

# ---- settings for the engine's processes, in vLLM's additional_config -------------------------------

#: Seconds a worker sleeps between checks for the engine's next step, where vLLM would spin
#: (:attr:`genlm_vllm.VLLMOptions.worker_wait`); absent: vLLM's own wait.
WORKER_NAP = "genlm_worker_nap_s"


def worker_nap(vllm_config: Any) -> float | None:
    """The :data:`WORKER_NAP` an engine was started with (None: vLLM's own wait)."""
    settings = getattr(vllm_config, "additional_config", None)
    value = settings.get(WORKER_NAP) if isinstance(settings, dict) else None
    return None if value is None else float(value)


# ---- context fingerprints -------------------------------------------------------------------------

#: Ids a fingerprint reads: the last ones and as many spread over the context. A check against a
#: request run on another context (a bookkeeping bug), not against an adversary: a wrong request
#: differs in its length, its last ids or its start; each side reads at most 16 ids per row.
FINGERPRINT_SAMPLE = 8


@functools.lru_cache(maxsize=4096)
def fingerprint_positions(length: int) -> tuple[int, ...]:
    """The positions of a context of ``length`` tokens that :func:`context_fingerprint` reads: in
    order, each once (kept for the lengths a step's contexts have)."""
    spread = range(0, length, length // FINGERPRINT_SAMPLE + 1)
    return tuple(sorted({*spread, *range(max(0, length - FINGERPRINT_SAMPLE), length)}))


@functools.lru_cache(maxsize=4096)
def split_positions(length: int, first: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`fingerprint_positions` of ``length`` as (those below ``first``, those from ``first`` on,
    less ``first``): where a context held as ``first`` prompt ids and its output ids is read."""
    positions = fingerprint_positions(length)
    return tuple(i for i in positions if i < first), tuple(i - first for i in positions if i >= first)


def context_fingerprint(token_ids: Sequence[int]) -> list[int]:
    """``[length, hash]`` of a context, the hash of the ids at :func:`fingerprint_positions` (ints
    hash alike in every process): what the engine checks a request runs on, in time independent of
    the context's length. Rows are matched by tag; this catches a request run on another context."""
    positions = fingerprint_positions(len(token_ids))
    sample = token_ids.take(positions) if isinstance(token_ids, Context) else [token_ids[i] for i in positions]
    return fingerprint(len(token_ids), sample)


def fingerprint(length: int, sample: Sequence[int]) -> list[int]:
    """The :func:`context_fingerprint` of a context of ``length`` tokens whose ids at
    :func:`fingerprint_positions` are ``sample`` (for the engine, which holds them elsewhere)."""
    return [length, hash(tuple(sample))]


# ---- the shared-memory slot file ------------------------------------------------------------------

WRITING = -1  #: a slot's flag while its row is being written
#: A slot file's mode: its owner's alone (rows are what a program computes), as Python's and vLLM's own
#: shared memory (``multiprocessing``'s semaphores and ``SharedMemory``) are made.
FILE_MODE = 0o600


class Segment:
    """A caller-owned shared-memory file of ``n`` slots: ``n`` int64 flags, then ``n`` float32 rows.

    The caller creates it (``create=True``: a new file, readable and writable by its owner only,
    :data:`FILE_MODE`, whatever the umask) and reads rows; the engine's writing rank, a process of the
    same user, opens it by path and writes them (:meth:`write`)."""

    def __init__(self, path: str, n: int, width: int, create: bool = False):
        self.path, self.n, self.width = path, n, width
        size = n * 8 + n * width * 4
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)  # a umask can only narrow the mode; one that took the owner's write away
                os.ftruncate(fd, size)  # would leave a file this process cannot map
            finally:
                os.close(fd)
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.flags = raw[: n * 8].view(torch.int64)
        self.data = raw[n * 8 :].view(torch.float32).view(n, width)

    def write(self, index: int, seq: int, row: torch.Tensor) -> None:
        """Seqlock write: mark the slot busy, copy the row (at most ``width`` entries), then publish
        the request's number."""
        self.flags[index] = WRITING
        row = row[: self.width]
        self.data[index, : row.shape[0]].copy_(row)
        self.flags[index] = seq
