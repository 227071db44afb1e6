"""How an engine's own processes start: spawned, or forked from a server that imported vLLM once.

vLLM starts its engine core, its tensor/pipeline-parallel workers and its data-parallel coordinator
with ``multiprocessing``; genlm-vllm always asks for the ``spawn`` method, since forking a process
that holds threads is unsafe. A spawned process is a fresh interpreter that imports vLLM again:
about 10 s of CPU each on vLLM's CPU build. With ``start_method="forkserver"``, those processes are
forked instead from multiprocessing's fork server: one single-threaded process per caller, started
once, which imports vLLM once (:func:`forkserver_context`). Three things differ from spawning, and
each is handled here:

- **The environment.** A forked process inherits the server's environment (as it was when the
  server started), not the caller's. :class:`CallerEnvProcess` carries the caller's environment at
  ``start()`` (with what genlm-vllm and vLLM set for that engine) and sets it in the new process
  before its target runs.
- **What an interpreter reads once, when it starts** (``PYTHONPATH`` and ``sitecustomize``,
  ``PYTHONHASHSEED``, ``LD_PRELOAD``, ...). A forked process cannot read those again, so where they
  differ from the server's, the engine's processes are spawned (:func:`forkserver_context` returns
  None and says why in the log).
- **OpenMP's thread count**, read when torch loads (in the server): a process whose
  ``OMP_NUM_THREADS`` differs from the server's sets it with ``torch.set_num_threads``.

Nothing here imports vLLM; which modules the server imports is the caller's choice
(:func:`genlm_vllm.vllm_api.engine_process_modules`).
"""

from __future__ import annotations

import logging
import multiprocessing.forkserver
import os
import sys
from multiprocessing import context as mp_context
from typing import Any

log = logging.getLogger("genlm_vllm")

#: Prefixes of the variables a process reads when its interpreter or a library starts (the OpenMP
#: runtime reads its thread affinity when torch loads it), which a forked process cannot read again.
#: vLLM's CPU build gives each tensor-parallel worker its own OpenMP affinity this way, so those
#: workers are always spawned.
READ_AT_START = ("PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_", "MKL_")
#: Read at start too, but a forked process sets it itself (``torch.set_num_threads``).
THREADS = "OMP_NUM_THREADS"

_server_pid: int | None = None  # the fork server this module started, and its environment then
_server_env: dict[str, str] | None = None


def read_at_start(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads only when it starts (but :data:`THREADS`)."""
    return {key: value for key, value in env.items() if key.startswith(READ_AT_START) and key != THREADS}


class CallerEnvProcess(mp_context.ForkServerProcess):
    """A process forked by multiprocessing's fork server that runs with the environment its caller had
    when it called ``start()``, not the server's."""

    _caller_env: dict[str, str]
    _server_threads: str | None

    def start(self) -> None:
        self._caller_env = dict(os.environ)
        self._server_threads = (_server_env if _server_env is not None else os.environ).get(THREADS)
        super().start()

    def run(self) -> None:
        for key in set(os.environ) - set(self._caller_env):  # changed, not cleared: a process title
            del os.environ[key]  # (setproctitle, as vLLM sets it) cannot be set in an emptied environment
        for key, value in self._caller_env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        threads = self._caller_env.get(THREADS)
        if threads is not None and threads != self._server_threads and "torch" in sys.modules:
            try:
                sys.modules["torch"].set_num_threads(int(threads))
            except ValueError:
                log.warning("genlm-vllm: %s=%r is not a thread count; left as the fork server had it", THREADS, threads)
        super().run()


class CallerEnvContext(mp_context.ForkServerContext):
    """multiprocessing's forkserver context whose processes are :class:`CallerEnvProcess`."""

    Process = CallerEnvProcess


def forkserver_context(preload: list[str]) -> CallerEnvContext | None:
    """A context that forks processes from this process's fork server, started now (importing the
    modules ``preload``, with the environment as it is now) if it is not running; None where the server
    cannot give a process what a spawned one would have: its start-time variables
    (:data:`READ_AT_START`) differ from ours now, it was started by someone else (its environment is
    unknown), or this platform has no fork server. Says why in the log, once per reason."""
    global _server_pid, _server_env
    if "forkserver" not in multiprocessing.get_all_start_methods():
        _spawning_because("this platform has no fork server")
        return None
    server: Any = multiprocessing.forkserver._forkserver
    running = server._forkserver_pid
    if running is not None and running != _server_pid:
        _spawning_because("a fork server started elsewhere runs here (its environment is unknown)")
        return None
    ours, server_start = read_at_start(os.environ), read_at_start(_server_env or {})
    if running is not None and server_start != ours:
        changed = sorted(k for k in set(ours) | set(server_start) if ours.get(k) != server_start.get(k))
        _spawning_because(f"{', '.join(changed)} changed since the fork server started (read once, at a start)")
        return None
    context = CallerEnvContext()
    context.set_forkserver_preload([__name__, *preload])
    multiprocessing.forkserver.ensure_running()  # (re)starts it with our environment if it is not running
    if server._forkserver_pid != _server_pid:
        _server_pid, _server_env = server._forkserver_pid, dict(os.environ)
        log.info("genlm-vllm: fork server started (pid %s), importing %s", _server_pid, ", ".join(preload))
    return context


_said: set[str] = set()


def _spawning_because(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.info("genlm-vllm: the engine's processes are spawned: %s", reason)
