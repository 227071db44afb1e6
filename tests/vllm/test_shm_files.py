"""genlm-vllm's ``/dev/shm`` row-slot files are created readable and writable by their owner only (``0600``),
whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from genlm_vllm.rows import SharedMemoryRows
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
