"""Where vLLM's engine and workers run, and the environment they start with.

An engine runs in one of these layouts (:func:`layout` decides from the options):

- in-process (the default): the engine core and the model live in the caller's process;
- multiprocess: vLLM's engine core runs in a process of its own (vLLM's own default; always so
  for ``AsyncLLM``);
- tensor/pipeline parallel: one worker process per rank, spawned by the engine core.

Every layout but the first spawns processes. This module gives them a working CPU thread binding,
and refuses, with the fix named, a script that would re-run itself in every spawned process.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

log = logging.getLogger(__name__)

BIND = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class Layout:
    """How an engine is laid out over processes, and how its rows come back."""

    streaming: bool  #: AsyncLLM (requests stream in) rather than LLM (one generate per batch)
    multiprocess: bool  #: the engine core runs in its own process
    tensor_parallel: int
    pipeline_parallel: int
    ray: bool  #: vLLM's Ray executor: workers may sit on other hosts
    capture: str  #: "local", "shm" or "rpc"
    data_parallel: int = 1  #: vLLM's data-parallel engines (AsyncLLM only)
    ray_address: str | None = None  #: the Ray cluster to join, if one was named

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def spawns(self) -> bool:
        """Whether starting the engine starts other processes."""
        return self.multiprocess or self.world_size > 1 or self.data_parallel > 1

    def describe(self) -> str:
        parts = ["AsyncLLM" if self.streaming else "LLM", "multiprocess" if self.multiprocess else "in-process"]
        if self.tensor_parallel > 1:
            parts.append(f"TP={self.tensor_parallel}")
        if self.pipeline_parallel > 1:
            parts.append(f"PP={self.pipeline_parallel}")
        if self.data_parallel > 1:
            parts.append(f"DP={self.data_parallel}")
        if self.ray:
            parts.append("Ray")
        return ", ".join(parts) + f"; rows by {self.capture}"


def layout(options: Any) -> Layout:
    """The layout ``options`` (:class:`~genlm_vllm.VLLMOptions`) ask for; ValueError if impossible."""
    opts = options.engine_opts
    streaming = options.engine == "async"
    multiprocess = options.multiprocess
    if multiprocess is None:
        multiprocess = streaming
    if streaming and not multiprocess:
        raise ValueError("engine='async' (AsyncLLM) always runs its engine core in its own process: multiprocess=False")
    tp = int(opts.get("tensor_parallel_size", 1))
    pp = int(opts.get("pipeline_parallel_size", 1))
    dp = int(opts.get("data_parallel_size", 1))
    if dp > 1 and not streaming:
        raise ValueError(
            "data_parallel_size > 1 runs only under AsyncLLM (vLLM refuses it for LLM): set engine='async', "
            "or use replicas=N for N independent engines behind one client"
        )
    if getattr(options, "replicas", 1) > 1 and (streaming or dp > 1):
        raise ValueError(
            "replicas=N runs N LLM engines as Ray actors: use it with engine='llm' and no data_parallel_size "
            "(for vLLM's own data parallel, use engine='async' with data_parallel_size instead)"
        )
    ray = opts.get("distributed_executor_backend") == "ray" or opts.get("data_parallel_backend") == "ray"
    automatic = "rpc" if ray else "local" if not multiprocess and tp * pp == 1 else "shm"
    capture = automatic if options.capture == "auto" else options.capture
    if capture == "local" and automatic != "local":
        raise ValueError(
            "capture='local' needs the model in this process (engine='llm', multiprocess=False, no TP/PP); "
            f"this engine would run it elsewhere: use capture='shm' or 'rpc' (or 'auto': {automatic!r})"
        )
    if capture == "shm" and ray:
        raise ValueError("capture='shm' cannot reach Ray workers on other hosts: use capture='rpc'")
    address = getattr(options, "ray_address", None) or os.environ.get("RAY_ADDRESS")
    return Layout(streaming, multiprocess, tp, pp, ray, capture, dp, address)


def allowed_cores() -> list[int]:
    """The CPU cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (vLLM's CPU list syntax)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def threads_bind(ranks: int, cores: list[int]) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value for ``ranks`` worker processes on ``cores``: each rank
    gets a contiguous share (``"0|1"``, ``"0-7|8-15"``). With more ranks than cores, ranks share
    cores round-robin (slow, but it runs)."""
    if not cores:
        raise RuntimeError("this process may run on no CPU core: no thread binding can work")
    if ranks > len(cores):
        log.warning("genlm-vllm: %d worker processes share %d cores; expect them to be slow", ranks, len(cores))
        return "|".join(str(cores[i % len(cores)]) for i in range(ranks))
    share, extra = divmod(len(cores), ranks)
    parts, start = [], 0
    for rank in range(ranks):
        size = share + (rank < extra)
        parts.append(_cpu_list(cores[start : start + size]))
        start += size
    return "|".join(parts)


def on_cpu_build() -> bool:
    """Whether vLLM will run on the CPU (no CUDA device here)."""
    import torch

    return not torch.cuda.is_available()


def engine_env(lay: Layout) -> dict[str, str]:
    """Environment variables the engine (and the processes it spawns) must start with."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if lay.multiprocess else "0"}
    if lay.ray and (address := lay.ray_address or _connected_ray_address()):
        env["RAY_ADDRESS"] = address  # an engine core in its own process joins the same cluster
    if lay.spawns:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # forking a process that holds threads is unsafe
        if on_cpu_build() and not lay.ray:
            bind = os.environ.get(BIND)
            if bind is None or bind == "auto":  # vLLM's auto binding needs one NUMA node per rank
                env[BIND] = threads_bind(lay.world_size, allowed_cores())
            elif bind != "nobind" and len(bind.split("|")) != lay.world_size:
                raise ValueError(
                    f"{BIND}={bind!r} binds {len(bind.split('|'))} ranks, but this engine has {lay.world_size} "
                    "(tensor x pipeline parallel): give one CPU list per rank, separated by '|', or unset it"
                )
    return env


def _connected_ray_address() -> str | None:
    """The cluster this process is connected to, if any."""
    if "ray" not in sys.modules:
        return None
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


@contextlib.contextmanager
def engine_start(lay: Layout) -> Iterator[None]:
    """Start an engine in ``lay``: set ``engine_env(lay)`` while it starts (its processes inherit
    it), then restore ours. vLLM caches its settings once an engine has started in this process:
    that cache is dropped first. An engine whose model runs in other processes leaves this
    process's torch thread count as it was (vLLM's executor sets it to 1 for itself, which would
    slow the caller's own torch work and break a later in-process CPU engine)."""
    import torch
    from vllm import envs

    env = engine_env(lay)
    envs.disable_envs_cache()
    saved = {key: os.environ.get(key) for key in env}
    threads = torch.get_num_threads()
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if lay.spawns and torch.get_num_threads() != threads:
            torch._C.set_num_threads(threads)  # the real one: an in-process CPU engine replaces torch's


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


@cache
def modes_here() -> str:
    """Which execution modes this machine can run, for ``genlm backends`` and the docs."""
    import torch

    if torch.cuda.is_available():
        devices = torch.cuda.device_count()
        where = f"{devices} CUDA device(s)"
    else:
        devices = len(allowed_cores())
        where = f"vLLM's CPU build on {devices} core(s)"
    modes = ["in-process", "multiprocess", "AsyncLLM (engine='async')"]
    if devices > 1:
        modes.append(f"tensor/pipeline parallel up to {devices} ranks")
    else:
        modes.append("TP/PP only with ranks sharing one device (slow)")
    ray = (
        "Ray executor, replicas and data parallel available"
        if importlib.util.find_spec("ray")
        else "no Ray (pip install 'genlm-vllm[ray]') for multi-node"
    )
    return f"{where}: {', '.join(modes)}; {ray}"


SHM_DIR = "/dev/shm"


def _in_use(paths: set[str]) -> set[str]:
    """Which of ``paths`` some live process still maps or holds open."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                used.update(p for p in paths if p in f.read())
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    target = os.readlink(os.path.join(fd_dir, fd))
                    if target in paths:
                        used.add(target)
        except OSError:  # gone, or not ours to read
            continue
    return used


class EngineFiles:
    """The shared-memory files vLLM's processes create while an engine starts (message queues,
    CPU communicators, semaphores), so that :meth:`remove_orphans` can delete what a crashed or
    killed process leaves behind. Only files that appeared during the start, and that no live
    process maps or holds open, are removed."""

    def __init__(self) -> None:
        self._before = self._names()
        self.created: set[str] = set()

    @staticmethod
    def _names() -> set[str]:
        try:
            return set(os.listdir(SHM_DIR))
        except FileNotFoundError:
            return set()

    def started(self) -> None:
        """Call once the engine is up: remember what it created."""
        self.created = {os.path.join(SHM_DIR, n) for n in self._names() - self._before if not n.startswith("genlm-")}

    def remove_orphans(self, grace: float = 0.0) -> list[str]:
        """Delete the engine's files that nothing uses any more; returns their paths. With ``grace``,
        wait up to that many seconds for processes that still use some to exit (Ray kills actors
        asynchronously)."""
        deadline = time.monotonic() + grace
        removed: list[str] = []
        while True:
            left = {p for p in self.created if os.path.exists(p)}
            used = _in_use(left) if left else set()
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
