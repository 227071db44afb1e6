"""genlm_vllm.start.processes, without vLLM: processes forked from the fork server run with their caller's
environment as it was when they started, bound to the cores OpenMP binds a spawned process to (the spawned
one is the reference), and the server is not used where a forked process could not have what a spawned
one would (a start-time variable changed since the server started, a binding of each thread to a core of
its own).

Each check runs in a fresh interpreter (``SCRIPT``): the fork server is one per process, and the
session's own serves its vLLM engines with vLLM imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.process]
pytest.importorskip("setproctitle", reason="installed with vLLM (pip install 'genlm-vllm[cpu]')")

SCRIPT = """
import json, multiprocessing, os, sys
import setproctitle
import torch
from genlm_vllm.start import processes


def report(conn):
    setproctitle.setproctitle("VLLM::Test")  # as vLLM names its processes
    with open("/proc/self/comm") as comm:
        title = comm.read().strip()
    torch.ones(256, 256) @ torch.ones(256, 256)  # OpenMP starts its threads
    conn.send({
        "mark": os.environ.get("GENLM_TEST_MARK"),
        "threads": torch.get_num_threads(),
        "parent": os.getppid(),
        "title": title,
        "cores": sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}),
    })


def run(context):
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=report, args=(writer,))
    process.start()
    got = reader.recv()
    process.join()
    return got


if __name__ == "__main__":
    context = processes.forkserver_context(["torch"])
    server = processes._server_pid
    threads = torch.get_num_threads()
    os.environ["GENLM_TEST_MARK"] = "set after the server started"
    os.environ["OMP_NUM_THREADS"] = str(threads + 1)
    forked = run(context)
    os.environ["GENLM_TEST_MARK"] = "changed again"
    again = run(processes.forkserver_context(["torch"]))
    os.environ["PYTHONGENLMTEST"] = "1"  # read when an interpreter starts
    refused = processes.forkserver_context(["torch"])
    del os.environ["PYTHONGENLMTEST"]
    back = processes.forkserver_context(["torch"]) is not None
    os.environ["OMP_NUM_THREADS"] = "2"
    core = str(max(os.sched_getaffinity(0)))
    bound = {}
    for binding in ({"GOMP_CPU_AFFINITY": core}, {"OMP_PLACES": "{" + core + "}", "OMP_PROC_BIND": "close"}):
        os.environ.update(binding)
        forked_here = run(processes.forkserver_context(["torch"]))
        bound[str(binding)] = [forked_here, run(multiprocessing.get_context("spawn"))]
        for key in binding:
            del os.environ[key]
    os.environ["GOMP_CPU_AFFINITY"] = "0 1"  # thread 0 on core 0, thread 1 on core 1
    per_thread = processes.forkserver_context(["torch"])
    print(json.dumps({"server": server, "me": os.getpid(), "threads": threads, "forked": forked, "again": again,
                      "refused": refused is None, "back": back, "core": int(core), "bound": bound,
                      "per_thread": per_thread is None}))
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
    assert got["forked"] == {**want, "cores": [sorted(os.sched_getaffinity(0))]}
    assert got["again"]["mark"] == "changed again" and got["again"]["parent"] == got["server"]
    assert got["refused"] and got["back"]
    for binding, (forked, spawned) in got["bound"].items():  # what OpenMP did in the spawned one
        assert spawned["parent"] == got["me"] and forked["parent"] == got["server"], binding
        assert forked["cores"] == spawned["cores"] == [[got["core"]]], binding
        assert forked["threads"] == spawned["threads"] == 2, binding
    assert got["per_thread"]
