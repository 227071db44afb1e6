"""Shared-memory files in ``/dev/shm``: ours (row slots, named :data:`FILE_PREFIX`) and those vLLM's
processes create while an engine starts, removed once nothing uses them, also after a crash."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "genlm-vllm-"  #: every shared-memory file of ours starts with this


def process_parents() -> dict[int, int]:
    """The parent of every process this one can see in ``/proc``: ``{pid: parent pid}``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone
            continue
        # "pid (command) state ppid ...": the command may hold spaces and parentheses, so split after its last ")"
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int, parents: dict[int, int] | None = None) -> set[int]:
    """The processes that process ``pid`` started, and those they started, down the tree (now alive); a
    process whose parent exited before it was reparented and is no longer among them."""
    children: dict[int, list[int]] = {}
    for child, parent in (process_parents() if parents is None else parents).items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found


def _used_by(pid: str, paths: set[str]) -> set[str]:
    """Which of ``paths`` process ``pid`` maps or holds open (a name it maps or holds after the file was
    removed is another file: ``/proc`` writes it with `` (deleted)`` after it). Raises OSError where the
    process is gone or not this user's to read."""
    used: set[str] = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:  # "address perms offset dev inode path"
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5] in paths:
                used.add(fields[5])
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(os.path.join(fd_dir, fd))
            if target in paths:
                used.add(target)
    return used


def users(paths: set[str]) -> dict[str, set[int]]:
    """For each of ``paths``, the live processes that map it or hold it open (of those this user may
    read: another user's processes are not seen)."""
    found: dict[str, set[int]] = {path: set() for path in paths}
    if not paths:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            used = _used_by(pid, paths)
        except OSError:  # gone, or not ours to read
            continue
        for path in used:
            found[path].add(int(pid))
    return found


def in_use(paths: set[str], other_than: int | None = None) -> set[str]:
    """Which of ``paths`` some live process (other than process ``other_than``) still maps or holds
    open; a file nobody uses is left over."""
    return {path for path, pids in users(paths).items() if pids - {other_than}}


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


def shm_namespace() -> str:
    """Which ``/dev/shm`` and which process ids this process sees: equal in two processes exactly where
    each can find the other in ``/proc`` and both see the same ``/dev/shm`` files (the same machine, its
    boot, its pid namespace and its ``/dev/shm`` mount); a Ray worker on another host differs."""
    parts = []
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    for path in ("/proc/self/ns/pid", SHM_DIR):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


class EngineFiles:
    """The shared-memory files vLLM's processes create while an engine starts (message queues,
    CPU communicators, semaphores), so that :meth:`remove_orphans` can delete what a crashed or
    killed process leaves behind.

    A file is the engine's when it appeared during the start *and*, once the engine is up, the engine's
    own processes use it (map it or hold it open) and no other process does. The engine's processes
    are this one, the processes it started during the start (vLLM's engine core and workers, also those
    forked from a fork server this process started, and the data-parallel coordinator), and the workers
    the caller names (Ray's actors, children of Ray's daemons). So a file another engine made meanwhile
    (another program's, another test worker's) is never taken for this one's, even when both start at
    the same moment; nor is a file that nobody used by then (whose it was cannot be told). Of its
    files, :meth:`remove_orphans` removes those no other process uses once it is closed."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._before = names()
        self._children_before = descendants(self.pid)  # another engine's, a fork server started earlier
        self.created: set[str] = set()  #: the engine's files (after :meth:`started`)
        self.processes: set[int] = set()  #: the engine's processes, this one included (after :meth:`started`)

    def started(self, workers: Iterable[int] = ()) -> None:
        """Call once the engine is up, with the process ids of its ``workers`` that share this process's
        ``/dev/shm`` but are not this process's descendants (Ray's): remember the files it created."""
        made = {os.path.join(SHM_DIR, n) for n in names() - self._before if not n.startswith("genlm-")}
        self.processes = {self.pid, *(descendants(self.pid) - self._children_before), *workers}
        self.created = {path for path, pids in users(made).items() if pids & self.processes and pids <= self.processes}
        if made - self.created:
            log.debug(
                "genlm-vllm: %d files new in %s since the engine's start are not its processes' alone: left alone",
                len(made - self.created),
                SHM_DIR,
            )

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
