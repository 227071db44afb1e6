"""The shared-memory slot file: its format (:class:`Segment`, written by the engine's writing rank, read by
the caller) and its life (named :data:`FILE_PREFIX` with the creating process's id, removed when that
process is gone). Imports no vLLM."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "genlm-vllm-"  #: every shared-memory file of ours starts with this


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


def remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def leftover_files(pid: int | None = None, directory: str = SHM_DIR) -> list[str]:
    """Shared-memory files of genlm-vllm that still exist: those made by process ``pid``, or by any."""
    prefix = FILE_PREFIX if pid is None else f"{FILE_PREFIX}{pid}-"
    try:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (one that is someone else's exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        pass
    return False


def remove_files_of_dead_processes(directory: str = SHM_DIR) -> list[str]:
    """Remove our files whose creating process is gone (killed before it could clean up)."""
    removed = []
    for path in leftover_files(directory=directory):
        pid = os.path.basename(path)[len(FILE_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and process_gone(int(pid)):
            remove_files([path])
            removed.append(path)
    if removed:
        log.info("genlm-vllm: removed %d shared-memory files of processes that are gone", len(removed))
    return removed
