"""genlm_vllm.process_start, without vLLM: processes forked from the fork server run with their caller's
environment as it was when they started, and the server is not used where a forked process could not
have what a spawned one would (a start-time variable changed since the server started).

Each check runs in a fresh interpreter (``SCRIPT``): the fork server is one per process, and the
session's own serves its vLLM engines with vLLM imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.process]
pytest.importorskip("setproctitle", reason="installed with vLLM (pip install 'genlm-vllm[cpu]')")

SCRIPT = """
import json, os, sys
import setproctitle
import torch
from genlm_vllm import process_start


def report(conn):
    setproctitle.setproctitle("VLLM::Test")  # as vLLM names its processes
    with open("/proc/self/comm") as comm:
        title = comm.read().strip()
    conn.send({
        "mark": os.environ.get("GENLM_TEST_MARK"),
        "threads": torch.get_num_threads(),
        "parent": os.getppid(),
        "title": title,
    })


def run(context):
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=report, args=(writer,))
    process.start()
    got = reader.recv()
    process.join()
    return got


if __name__ == "__main__":
    context = process_start.forkserver_context(["torch"])
    server = process_start._server_pid
    threads = torch.get_num_threads()
    os.environ["GENLM_TEST_MARK"] = "set after the server started"
    os.environ["OMP_NUM_THREADS"] = str(threads + 1)
    forked = run(context)
    os.environ["GENLM_TEST_MARK"] = "changed again"
    again = run(process_start.forkserver_context(["torch"]))
    os.environ["PYTHONGENLMTEST"] = "1"  # read when an interpreter starts
    refused = process_start.forkserver_context(["torch"])
    del os.environ["PYTHONGENLMTEST"]
    back = process_start.forkserver_context(["torch"]) is not None
    print(json.dumps({"server": server, "me": os.getpid(), "threads": threads, "forked": forked, "again": again,
                      "refused": refused is None, "back": back}))
"""


def test_forked_processes_run_with_their_callers_environment_and_start_variables_fall_back_to_spawn(tmp_path):
    script = tmp_path / "forked.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["server"] not in (None, got["me"])
    want = {
        "mark": "set after the server started",
        "threads": got["threads"] + 1,
        "parent": got["server"],
        "title": "VLLM::Test",
    }
    assert got["forked"] == want
    assert got["again"]["mark"] == "changed again" and got["again"]["parent"] == got["server"]
    assert got["refused"] and got["back"]
