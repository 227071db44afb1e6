"""The shared-memory files an engine's processes make in ``/dev/shm`` (named with the engine's tag:
:class:`EngineFiles`), removed once nothing uses them, also after a crash. Our own row-slot files are
:mod:`genlm_vllm.transport.shm`'s."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory

from genlm_vllm.transport import shm
from genlm_vllm.transport.shm import FILE_PREFIX, process_gone, remove_files

log = logging.getLogger(__name__)


def _shm_files_of(pid: str, paths: set[str] | None) -> set[str]:
    """The files in ``/dev/shm`` (or of ``paths``) process ``pid`` maps or holds open, that are still there."""
    found: set[str] = set()
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            path = line.rstrip("\n").partition("/dev/shm/")
            if path[1] and not path[2].endswith(" (deleted)"):
                found.add(shm.SHM_DIR + "/" + path[2])
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(os.path.join(fd_dir, fd))
            if target.startswith(shm.SHM_DIR + "/"):
                found.add(target)
    return found if paths is None else found & paths


def in_use(paths: set[str], other_than: int | None = None) -> set[str]:
    """Which of ``paths`` some live process (other than process ``other_than``) still maps or holds
    open; a file nobody uses is left over."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == other_than:
            continue
        with contextlib.suppress(OSError):  # gone, or not ours to read
            used |= _shm_files_of(pid, paths)
    return used


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces): state first, then
    the parent's pid; the start time is the 20th. None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(root: int | None = None) -> dict[int, str]:
    """The live processes under process ``root`` (this one), each with its start time (so that a pid used
    again is not taken for the same process)."""
    root = os.getpid() if root is None else root
    parents: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parents[int(entry)] = (int(fields[1]), fields[19])  # ppid, starttime
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def files_used_by(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files these processes map or hold open now."""
    used: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            used |= _shm_files_of(str(pid), None)
    return used


def names(directory: str | None = None) -> set[str]:
    """The names of the files in ``directory`` (``/dev/shm``) now."""
    try:
        return set(os.listdir(directory or shm.SHM_DIR))
    except FileNotFoundError:
        return set()


def left_since(before: set[str], directory: str | None = None, other_than: int | None = None) -> set[str]:
    """Paths of the files made in ``directory`` (``/dev/shm``) since it held the names ``before`` that no live
    process (other than ``other_than``) uses: left behind. A file some live process still uses is that process's
    (another engine's, another program's)."""
    directory = directory or shm.SHM_DIR
    made = {os.path.join(directory, n) for n in names(directory) - before}
    return made - in_use(made, other_than) if made else set()


#: Every shared-memory file an engine's processes make through Python's ``multiprocessing`` (its semaphores,
#: ``sem.mp-...``, and ``SharedMemory`` segments such as vLLM's message queues, ``psm_...``) carries
#: ``ENGINE_MARK + tag + "-"`` in its name, ``tag`` being that engine's own (:class:`EngineFiles`).
ENGINE_MARK = "genlm-engine-"
#: The key of multiprocessing's process configuration that carries an engine's :class:`FileTag` to its
#: processes (each process copies its parent's configuration: see :meth:`EngineFiles.marking`).
CONFIG_KEY = "genlm_vllm_engine_files"

#: Seconds :meth:`EngineFiles.remove_orphans` waits for the engine's own processes to exit and let go of its files.
OWN_EXIT_S = 10.0

_marking = threading.Lock()  # one engine of this process marks its processes at a time


def _tagged_filename(tag: str) -> Callable[[], str]:
    def make_filename() -> str:  # shared_memory._make_filename's shape: a leading "/", then the name
        return f"/psm_{ENGINE_MARK}{tag}-{secrets.token_hex(4)}"

    return make_filename


def mark_this_process(tag: str) -> None:
    """From now on, the semaphores and shared-memory segments this process makes through ``multiprocessing``
    carry ``tag`` in their names (the names' prefix is a setting of the standard library's: a semaphore's is
    the process configuration's ``semprefix``, a segment's ``shared_memory._make_filename``)."""
    multiprocessing.current_process()._config["semprefix"] = f"/mp-{ENGINE_MARK}{tag}"  # type: ignore[attr-defined]
    shared_memory._make_filename = _tagged_filename(tag)  # type: ignore[attr-defined]


class FileTag:
    """An engine's tag, as it travels in a process's configuration: a process that multiprocessing starts
    (spawned, or forked from a fork server) unpickles its parent's configuration before its target runs, and
    unpickling this marks that process (:func:`mark_this_process`). A forked process inherits its parent's
    marks as they are."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self) -> tuple[Callable[[str], FileTag], tuple[str]]:
        return _marked, (self.tag,)


def _marked(tag: str) -> FileTag:
    mark_this_process(tag)
    return FileTag(tag)


def _unmarked(name: str) -> bool:
    """Whether a file's name carries neither an engine's tag nor our row slots' prefix."""
    return ENGINE_MARK not in name and not name.startswith(FILE_PREFIX)


def engine_files(tag: str, directory: str | None = None) -> set[str]:
    """Paths of the files in ``directory`` (``/dev/shm``) whose names carry the engine tag ``tag``."""
    directory = directory or shm.SHM_DIR
    return {os.path.join(directory, n) for n in names(directory) if f"{ENGINE_MARK}{tag}-" in n}


class EngineFiles:
    """The shared-memory files of one engine's processes (message queues, semaphores), found by the tag in
    their names, so that :meth:`remove_orphans` can delete what the engine leaves behind, also after a crash
    or a killed process, and nothing of another engine's, started at the same moment or not.

    While the engine starts (:meth:`marking`), this process and every process that multiprocessing starts
    from it (vLLM's engine core, its workers, their own children) name their semaphores and shared-memory
    segments with the engine's tag. A file made otherwise (by C code, with a name of its own) is the engine's
    where it appeared while the engine started and the processes started for it use it once it has started
    (:attr:`untagged`): ``/dev/shm`` is read then, for the processes under this one that were not there
    before. A file made before the start is never the engine's, even where its processes use it (a queue
    of the caller's handed to them)."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid()}x{secrets.token_hex(3)}"  #: in the name of every file of this engine's
        #: Files without the tag that appeared while the engine started and that its processes used once it
        #: had started: those that C code
        #: makes with names of its own (vLLM's CPU build names its tensor-parallel all-reduce buffers
        #: ``vllm_dist_<id>-...-cpushm_<rank>``); on Ray, those that appeared while it started (:meth:`marking`).
        self.untagged: set[str] = set()
        #: The processes started for the engine (pid: start time), as they were once it had started.
        self.processes: dict[int, str] = {}

    @contextlib.contextmanager
    def marking(self, ray: bool = False) -> Iterator[None]:
        """While the engine starts: the processes made in it carry this engine's tag (see the class). The
        marks of this process are put back after, so that what it makes later is not the engine's.

        With ``ray``, the engine's workers are Ray actors, started by Ray's own daemons: neither marked nor
        under this process. Their files (pipeline-parallel message queues) are then taken by time, as files
        that appeared while the engine started, have no engine's tag and are not row slots; another engine
        on the same machine could lose such a file to this one's close only where it appeared in that window
        and nobody used it at the close."""
        with _marking:
            config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
            saved = config.get("semprefix"), config.get(CONFIG_KEY), shared_memory._make_filename  # type: ignore[attr-defined]
            before, names_before = descendants(), names()
            mark_this_process(self.tag)
            config[CONFIG_KEY] = FileTag(self.tag)
            try:
                yield
                self.processes = {pid: at for pid, at in descendants().items() if before.get(pid) != at}
                used = {os.path.relpath(path, shm.SHM_DIR) for path in files_used_by(list(self.processes))}
                appeared = names() - names_before  # a file that was there before is never the engine's
                taken = appeared if ray else used & appeared
                self.untagged = {os.path.join(shm.SHM_DIR, n) for n in taken if _unmarked(n)}
            finally:
                config["semprefix"] = saved[0]
                if saved[1] is None:
                    config.pop(CONFIG_KEY, None)
                else:
                    config[CONFIG_KEY] = saved[1]
                shared_memory._make_filename = saved[2]  # type: ignore[attr-defined]

    def _running(self) -> bool:
        """Whether a process started for the engine still runs (a zombie has unmapped everything)."""
        for pid, started in self.processes.items():
            fields = _stat(pid)
            if fields is not None and fields[19] == started and fields[0] != "Z":
                return True
        return False

    def files(self) -> set[str]:
        """Paths of this engine's files in ``/dev/shm`` now: those with its tag, and those without that its
        processes used once it had started (:attr:`untagged`)."""
        return engine_files(self.tag) | {p for p in self.untagged if os.path.exists(p)}

    def remove_orphans(self, grace: float = 0.0) -> list[str]:
        """Once the engine is closed: delete its files that no other process uses; returns their paths.
        This process's own hold does not keep one: vLLM's pipeline-parallel engine over Ray keeps a
        message queue of the caller's referenced after its shutdown, and its file stayed in ``/dev/shm``
        (240 MB) after the caller exited; the mapping stays valid until then. With ``grace``, wait up to
        that many seconds for other processes that still use some to exit (Ray kills actors
        asynchronously). Files still used by the engine's own processes are waited for up to :data:`OWN_EXIT_S`
        while those processes exit."""
        start = time.monotonic()
        removed: list[str] = []
        while True:
            left = self.files()
            used = in_use(left, other_than=os.getpid()) if left else set()
            for path in sorted(left - used):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(path)
            waited = time.monotonic() - start
            if not used or (waited >= grace and (waited >= OWN_EXIT_S or not self._running())):
                break
            time.sleep(0.1)
        if removed:
            log.info("genlm-vllm: removed %d shared-memory files left by the engine's processes", len(removed))
        if used:
            log.info("genlm-vllm: %d of the engine's shared-memory files are still in use", len(used))
        return removed


def remove_files_of_dead_engines(directory: str = shm.SHM_DIR) -> list[str]:
    """Remove the files of engines whose caller is gone (killed before it could close the engine: the tag
    starts with the caller's process id) and that no live process uses."""
    gone: set[str] = set()
    for name in names(directory):
        found = re.search(rf"{ENGINE_MARK}(\d+)x[0-9a-f]+-", name)
        if found is not None and process_gone(int(found.group(1))):
            gone.add(os.path.join(directory, name))
    removed = sorted(gone - in_use(gone)) if gone else []
    remove_files(removed)
    if removed:
        log.info("genlm-vllm: removed %d shared-memory files of engines whose caller is gone", len(removed))
    return removed
