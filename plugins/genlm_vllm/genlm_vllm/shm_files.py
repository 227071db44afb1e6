"""Shared-memory files in ``/dev/shm``: ours (row slots, named :data:`FILE_PREFIX`) and those vLLM's
processes create while an engine starts, removed once nothing uses them, also after a crash."""

from __future__ import annotations

import contextlib
import logging
import os
import time

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "genlm-vllm-"  #: every shared-memory file of ours starts with this


def in_use(paths: set[str], other_than: int | None = None) -> set[str]:
    """Which of ``paths`` some live process (other than process ``other_than``) still maps or holds
    open; a file nobody uses is left over."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == other_than:
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                used.update(p for p in paths if p in f.read())
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    target = os.readlink(os.path.join(fd_dir, fd))
                    if target in paths:
                        used.add(target)
        except OSError:  # gone, or not ours to read
            continue
    return used


def names(directory: str | None = None) -> set[str]:
    """The names of the files in ``directory`` (``/dev/shm``) now."""
    try:
        return set(os.listdir(directory or SHM_DIR))
    except FileNotFoundError:
        return set()


def left_since(before: set[str], directory: str | None = None, other_than: int | None = None) -> set[str]:
    """Paths of the files made in ``directory`` (``/dev/shm``) since it held the names ``before`` that no live
    process (other than ``other_than``) uses: left behind. A file some live process still uses is that process's
    (another engine's, another program's)."""
    directory = directory or SHM_DIR
    made = {os.path.join(directory, n) for n in names(directory) - before}
    return made - in_use(made, other_than) if made else set()


class EngineFiles:
    """The shared-memory files vLLM's processes create while an engine starts (message queues,
    CPU communicators, semaphores), so that :meth:`remove_orphans` can delete what a crashed or
    killed process leaves behind. Only files that appeared during the start, and that no live
    process maps or holds open, are removed."""

    def __init__(self) -> None:
        self._before = names()
        self.created: set[str] = set()

    def started(self) -> None:
        """Call once the engine is up: remember what it created."""
        self.created = {os.path.join(SHM_DIR, n) for n in names() - self._before if not n.startswith("genlm-")}

    def remove_orphans(self, grace: float = 0.0) -> list[str]:
        """Once the engine is closed: delete its files that no other process uses; returns their paths.
        This process's own hold does not keep one: vLLM's pipeline-parallel engine over Ray keeps a
        message queue of the caller's referenced after its shutdown, and its file stayed in ``/dev/shm``
        (240 MB) after the caller exited; the mapping stays valid until then. With ``grace``, wait up to
        that many seconds for other processes that still use some to exit (Ray kills actors
        asynchronously)."""
        deadline = time.monotonic() + grace
        removed: list[str] = []
        while True:
            left = {p for p in self.created if os.path.exists(p)}
            used = in_use(left, other_than=os.getpid()) if left else set()
            for path in sorted(left - used):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
            if not used or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if removed:
            log.info("genlm-vllm: removed %d shared-memory files left by the engine's processes", len(removed))
        if used:
            log.info("genlm-vllm: %d of the engine's shared-memory files are still in use", len(used))
        return removed


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


def remove_files_of_dead_processes(directory: str = SHM_DIR) -> list[str]:
    """Remove our files whose creating process is gone (killed before it could clean up)."""
    removed = []
    for path in leftover_files(directory=directory):
        pid = os.path.basename(path)[len(FILE_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            remove_files([path])
            removed.append(path)
        except PermissionError:  # alive, someone else's
            pass
    if removed:
        log.info("genlm-vllm: removed %d shared-memory files of processes that are gone", len(removed))
    return removed
