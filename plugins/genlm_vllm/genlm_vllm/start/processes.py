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
- **OpenMP's thread binding** (:data:`BINDING`), read when torch loads too. vLLM's CPU build gives
  each tensor/pipeline-parallel worker its cores this way. Where the binding puts every thread on one
  same set of cores (:func:`bound_cores`: one place, or one CPU), a forked process binds itself to
  that set (``os.sched_setaffinity``), as OpenMP does in a spawned one; where it puts threads on
  different cores, the engine's processes are spawned.

A script whose top level would start an engine again in each spawned process is refused first
(:func:`check_main_guard`). Nothing here imports vLLM; which modules the server imports is the caller's choice
(:func:`genlm_vllm.vllm_api.client.engine_process_modules`).
"""

from __future__ import annotations

import ast
import inspect
import logging
import multiprocessing.forkserver
import os
import re
import sys
from multiprocessing import context as mp_context
from typing import Any

log = logging.getLogger("genlm_vllm")

#: Prefixes of the variables a process reads when its interpreter or a library starts (the OpenMP
#: runtime reads its settings when torch loads it), which a forked process cannot read again.
READ_AT_START = ("PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_", "MKL_")
#: Read at start too, but a forked process sets it itself (``torch.set_num_threads``).
THREADS = "OMP_NUM_THREADS"
#: GNU OpenMP's thread binding, read at start; a forked process binds itself where :func:`bound_cores` can
#: say to which cores.
BINDING = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")

_server_pid: int | None = None  # the fork server this module started, and its environment then
_server_env: dict[str, str] | None = None


def read_at_start(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads only when it starts (but :data:`THREADS` and
    :data:`BINDING`, which a forked process applies itself)."""
    applied = (THREADS, *BINDING)
    return {key: value for key, value in env.items() if key.startswith(READ_AT_START) and key not in applied}


def bound_cores(env: dict[str, str] | os._Environ[str]) -> frozenset[int] | None:
    """The cores GNU OpenMP binds every thread of a process started with ``env`` to; None where it binds
    none (no :data:`BINDING` variable, or ``OMP_PROC_BIND=false``). Raises ``ValueError`` where it would
    bind threads to different cores (several places, several CPUs in ``GOMP_CPU_AFFINITY``, a binding
    policy without places) or the value is not understood: a process can bind itself only as a whole.

    >>> sorted(bound_cores({"OMP_PLACES": "{2,3}", "OMP_PROC_BIND": "true"}))  # vLLM's CPU build
    [2, 3]
    >>> sorted(bound_cores({"GOMP_CPU_AFFINITY": "1"})), bound_cores({"OMP_PROC_BIND": "false", "OMP_PLACES": "{1}"})
    ([1], None)
    """
    places, policy, cpus = (env.get(key) for key in BINDING)
    if policy is not None and policy.strip().lower() == "false":
        return None
    if places is not None and cpus is not None:
        raise ValueError("both OMP_PLACES and GOMP_CPU_AFFINITY are set")
    if places is not None:
        one_place = re.fullmatch(r"\s*\{\s*(\d+(?:\s*,\s*\d+)*)\s*\}\s*", places)
        if one_place is None:
            raise ValueError(f"OMP_PLACES={places!r} is not one place of listed cores")
        return frozenset(int(core) for core in one_place.group(1).split(","))
    if cpus is not None:
        numbers = re.fullmatch(r"\s*\d+([\s,]+\d+)*\s*", cpus) is not None  # not ranges such as 0-3
        listed = set(map(int, re.split(r"[\s,]+", cpus.strip()))) if numbers else set()
        if len(listed) != 1:
            raise ValueError(f"GOMP_CPU_AFFINITY={cpus!r} does not name one CPU")
        return frozenset(listed)
    if policy is not None:
        raise ValueError(f"OMP_PROC_BIND={policy!r} without OMP_PLACES binds each thread to a place of its own")
    return None


def _binding(env: dict[str, str] | os._Environ[str]) -> dict[str, str | None]:
    return {key: env.get(key) for key in BINDING}


def cores_to_bind(env: dict[str, str] | os._Environ[str], server_env: dict[str, str]) -> frozenset[int] | None:
    """The cores a process forked from a server started with ``server_env`` must bind itself to, to run as one
    started with ``env`` would: None where both bind alike. Raises ``ValueError`` where it cannot (the server
    binds its threads, differently, ``env`` binds threads to different cores (:func:`bound_cores`) or to cores
    this process may not run on, which OpenMP would skip and ``os.sched_setaffinity`` refuses).

    >>> cores_to_bind({"GOMP_CPU_AFFINITY": "0"}, {}), cores_to_bind({}, {})
    (frozenset({0}), None)
    >>> cores_to_bind({"GOMP_CPU_AFFINITY": "100000"}, {})
    Traceback (most recent call last):
    ...
    ValueError: OpenMP's binding names cores this process may not run on: [100000]
    """
    if _binding(env) == _binding(server_env):
        return None
    if bound_cores(server_env) is not None:
        raise ValueError("the fork server binds its threads (OpenMP's binding was set when it started)")
    cores = bound_cores(env)
    if cores is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("this platform has no os.sched_setaffinity")
    if outside := sorted(cores - os.sched_getaffinity(0)):
        raise ValueError(f"OpenMP's binding names cores this process may not run on: {outside}")
    return cores


class CallerEnvProcess(mp_context.ForkServerProcess):
    """A process forked by multiprocessing's fork server that runs with the environment its caller had
    when it called ``start()``, not the server's."""

    _caller_env: dict[str, str]
    _server_threads: str | None
    _cores: frozenset[int] | None

    def start(self) -> None:
        server_env = _server_env if _server_env is not None else dict(os.environ)
        self._caller_env = dict(os.environ)
        self._server_threads = server_env.get(THREADS)
        try:
            self._cores = cores_to_bind(self._caller_env, server_env)
        except ValueError as why:  # forkserver_context said it could: the binding changed since
            raise RuntimeError(f"genlm-vllm: a forked process cannot bind as asked: {why}") from None
        super().start()

    def run(self) -> None:
        for key in set(os.environ) - set(self._caller_env):  # changed, not cleared: a process title
            del os.environ[key]  # (setproctitle, as vLLM sets it) cannot be set in an emptied environment
        for key, value in self._caller_env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if self._cores is not None:  # before OpenMP starts a thread (torch.set_num_threads does): each inherits it
            os.sched_setaffinity(0, self._cores)
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
    (:data:`READ_AT_START`) differ from ours now, OpenMP's thread binding asked for now is not one a
    forked process can give itself (:func:`cores_to_bind`), it was started by someone else (its
    environment is unknown), or this platform has no fork server. Says why in the log, once per reason."""
    global _server_pid, _server_env
    if "forkserver" not in multiprocessing.get_all_start_methods():
        _spawning_because("this platform has no fork server")
        return None
    server: Any = multiprocessing.forkserver._forkserver
    running = server._forkserver_pid
    if running is not None and running != _server_pid:
        _spawning_because("a fork server started elsewhere runs here (its environment is unknown)")
        return None
    if running is not None:
        ours, server_start = read_at_start(os.environ), read_at_start(_server_env or {})
        if server_start != ours:
            changed = sorted(k for k in set(ours) | set(server_start) if ours.get(k) != server_start.get(k))
            _spawning_because(f"{', '.join(changed)} changed since the fork server started (read once, at a start)")
            return None
        try:
            cores_to_bind(os.environ, _server_env or {})
        except ValueError as why:
            _spawning_because(f"OpenMP's thread binding: {why}")
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


# ---- the caller's main guard ------------------------------------------------------------------------


def _inside_main_guard(tree: ast.Module, line: int) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
            and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        ):
            return True
    return False


def check_main_guard() -> None:
    """Refuse to start processes from a script's top level outside ``if __name__ == "__main__":``.

    Spawned processes import the caller's script again; without the guard each of them would start
    an engine of its own, and vLLM fails deep inside with an unrelated message.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.exists(path):
        return  # interactive sessions, notebooks, -c: nothing is re-imported
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            break
        frame = frame.f_back
    if frame is None:
        return
    line = frame.f_lineno
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    if not _inside_main_guard(tree, line):
        raise RuntimeError(
            f"{path}, line {line}: this engine starts worker processes, which re-import your script "
            "(vLLM spawns them). Put the code that starts the model under\n"
            '    if __name__ == "__main__":\n'
            "or use the in-process engine (multiprocess=False, no tensor/pipeline parallelism)."
        )
