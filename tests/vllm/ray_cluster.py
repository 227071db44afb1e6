"""A two-node Ray cluster on loopback addresses of this one machine, for tests and benchmarks.

Each node is a ``ray start --block`` child process with its own address (127.0.0.2 and 127.0.0.3;
never 127.0.0.1, which Ray rewrites), one CPU, one "GPU" (one vLLM worker slot), its own core for
vLLM's thread binding, and the test-only patches of ``ray_shim/sitecustomize.py`` on ``PYTHONPATH``.
``stop()`` ends the nodes by process id (``ray stop`` would end every Ray process on the machine);
a watchdog process does the same if the driver dies without calling it (a test timeout, a kill).

    python ray_cluster.py --reap-after PID TEMP_DIR SESSION...   # the watchdog
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHIM = Path(__file__).parent / "ray_shim"
HEAD, WORKER = "127.0.0.2", "127.0.0.3"
PORT = 6390
ADDRESS = f"{HEAD}:{PORT}"
MARK = "GENLM_TEST_RAY_CLUSTER"  # in every cluster process's environment: the cluster's temp dir
COMMON_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
}


def shim_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**COMMON_ENV, "PYTHONPATH": f"{SHIM}{os.pathsep}{path}" if path else str(SHIM)}


class LoopbackCluster:
    """Two Ray nodes on this machine; the driver (this process) joins as if it ran on the head node."""

    address = ADDRESS

    def __init__(self) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.saved_env: dict[str, str | None] = {}

    def start(self, timeout: float = 120) -> LoopbackCluster:
        ray = str(Path(sys.executable).parent / "ray")
        common = ["--num-cpus=1", "--num-gpus=1", "--object-store-memory=300000000", "--block"]
        # No log monitor (it streams the workers' logs to the driver; they stay in the temp dir), no usage stats.
        common += ["--include-log-monitor=false", "--disable-usage-stats"]
        head = [ray, "start", "--head", f"--node-ip-address={HEAD}", f"--port={PORT}", f"--temp-dir={self.temp}"]
        worker = [ray, "start", f"--address={ADDRESS}", f"--node-ip-address={WORKER}"]
        for argv, ip, core in ((head, HEAD, "0"), (worker, WORKER, "1")):
            env = {
                **os.environ,
                **shim_env(),
                "VLLM_HOST_IP": ip,
                "VLLM_CPU_OMP_THREADS_BIND": core,
                MARK: str(self.temp),
            }
            log = open(self.temp / f"node-{ip}.log", "wb")
            self.nodes.append(subprocess.Popen(argv + common, env=env, stdout=log, stderr=log, start_new_session=True))
            if argv is head:
                self._wait_for_port(timeout)
        sessions = [str(node.pid) for node in self.nodes]  # start_new_session: a node's pid is its session id
        subprocess.Popen(
            [sys.executable, __file__, "--reap-after", str(os.getpid()), str(self.temp), *sessions],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._set_driver_env()
        import ray as ray_module

        ray_module.init(address=ADDRESS)
        deadline = time.monotonic() + timeout
        while sum(n["Alive"] for n in ray_module.nodes()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the second Ray node did not join; logs in {self.temp}")
            time.sleep(0.5)
        return self

    def _wait_for_port(self, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.nodes[0].poll() is not None:
                raise RuntimeError(f"the Ray head node exited; log in {self.temp}")
            with socket.socket() as s:
                if s.connect_ex((HEAD, PORT)) == 0:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"the Ray head node did not open {ADDRESS}; log in {self.temp}")

    def _set_driver_env(self) -> None:
        env = {**shim_env(), "VLLM_HOST_IP": HEAD}
        self.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        import importlib.util

        spec = importlib.util.spec_from_file_location("genlm_test_ray_shim", SHIM / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        shim = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(shim)
        shim.install()  # the patches, for this process

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        reap(self.temp, self.sessions, grace=2)
        for node in self.nodes:
            node.wait()
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def processes(self) -> list[int]:
        """Ray processes started from this cluster's temp dir that are still alive."""
        return processes_of(self.temp, self.sessions)

    @property
    def sessions(self) -> list[int]:
        return [node.pid for node in self.nodes]


def processes_of(temp: Path, sessions: list[int]) -> list[int]:
    """Live processes of the cluster: those in the nodes' sessions, and those that left them (the
    GCS server) but carry the nodes' ``MARK`` variable. Neither alone finds all: Ray's agents
    overwrite their environment with a new process title."""
    mark = f"{MARK}={temp}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                state, _, _, session = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:4]
                if state == "Z":  # ended, not yet waited for by its parent
                    continue
                if int(session) in sessions or mark in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def reap(temp: Path, sessions: list[int], grace: float = 10) -> None:
    """End every process of the cluster (SIGTERM, then after ``grace`` seconds SIGKILL) and remove its temp
    dir. Once the driver has disconnected nothing of the cluster is kept: ``ray start --block``, the raylets
    and the GCS server outlive a SIGTERM by more than 10 s here."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        for pid in processes_of(temp, sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while processes_of(temp, sessions) and time.monotonic() < deadline:
            time.sleep(0.2)
    shutil.rmtree(temp, ignore_errors=True)


def reap_after(driver: int, temp: Path, sessions: list[int]) -> None:
    """Wait for the driver to exit, then end the cluster if it is still there."""
    while Path(f"/proc/{driver}").exists() and temp.exists():
        time.sleep(1)
    if temp.exists():
        reap(temp, sessions)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap-after"]:
    reap_after(int(sys.argv[2]), Path(sys.argv[3]), [int(s) for s in sys.argv[4:]])
