"""The environment an engine starts with: CPU thread binding for its workers, how its processes start
(spawned, or forked from a fork server: :mod:`genlm_vllm.start.processes`), the Ray cluster to join, and
the model runner (see :func:`engine_start`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator

from genlm_vllm.layout import Layout
from genlm_vllm.start.processes import forkserver_context
from genlm_vllm.vllm_api import client, release

log = logging.getLogger(__name__)

BIND = release.THREADS_BIND_VARIABLE


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


def engine_env(lay: Layout, runner: str | None = None) -> dict[str, str]:
    """Environment variables the engine (and the processes it spawns) must start with; ``runner``
    ("v1" or "v2") pins vLLM's model runner in all of them."""
    env = {release.MULTIPROCESSING_VARIABLE: "1" if lay.multiprocess else "0"}
    if runner is not None:
        env.update(release.runner_env(runner))
    if lay.ray and (address := lay.ray_address or _connected_ray_address()):
        env["RAY_ADDRESS"] = address  # an engine core in its own process joins the same cluster
    if lay.spawns:
        env[release.WORKER_START_VARIABLE] = "spawn"  # forking a process that holds threads is unsafe
        if release.on_cpu_build() and not lay.ray:
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


def forks_from_server(lay: Layout, start_method: str) -> bool:
    """Whether the processes of an engine laid out as ``lay``, whose options say ``start_method``, are
    forked from the fork server. ``"auto"`` forks on vLLM's CPU build (where importing vLLM in each
    spawned process is most of an engine's start) and spawns on CUDA. A process the fork server cannot
    give what a spawned one would have is spawned all the same (see
    :func:`~genlm_vllm.start.processes.forkserver_context`): on vLLM's CPU build, a tensor/pipeline-parallel
    worker whose OpenMP binding puts its threads on different cores."""
    if not lay.spawns or start_method == "spawn":
        return False
    return start_method == "forkserver" or release.on_cpu_build()


@contextlib.contextmanager
def engine_start(lay: Layout, runner: str | None = None, start_method: str = "spawn") -> Iterator[None]:
    """Start an engine in ``lay``: set ``engine_env(lay, runner)`` while it starts (its processes inherit
    it), then restore ours. Where :func:`forks_from_server` says so for ``start_method``, the processes
    vLLM would spawn are forked from this process's fork server instead (spawned where it cannot serve
    them: see :func:`~genlm_vllm.start.processes.forkserver_context`). vLLM caches its settings once an engine has
    started in this process: that cache is dropped first. An engine whose model runs in other processes
    leaves this process's torch thread count as it was (vLLM's executor sets it to 1 for itself, which
    would slow the caller's own torch work and break a later in-process CPU engine). See also
    :func:`hidden_from_vllm_kernel_scan`."""
    import torch

    env = engine_env(lay, runner)
    release.disable_settings_cache()
    saved = {key: os.environ.get(key) for key in env}
    threads = torch.get_num_threads()
    os.environ.update(env)
    try:
        choose = None
        if forks_from_server(lay, start_method):
            choose = functools.partial(forkserver_context, client.engine_process_modules())
        with hidden_from_vllm_kernel_scan(), client.processes_from(choose):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if lay.spawns and torch.get_num_threads() != threads:
            torch._C.set_num_threads(threads)  # the real one: an in-process CPU engine replaces torch's


@contextlib.contextmanager
def hidden_from_vllm_kernel_scan() -> Iterator[None]:
    """Starting an engine, vLLM's kernel dispatcher scans every module in ``sys.modules`` and calls
    ``vars()`` on their attributes; llvmlite's lazy FFI object (``llvmlite.binding.ffi.lib``, loaded
    once numba has compiled anything, e.g. a trie) answers that with a function wrapper and the scan
    crashes. Hide that one module from the scan; code holding it keeps its own reference."""
    name = "llvmlite.binding.ffi"
    module = sys.modules.pop(name, None)
    try:
        yield
    finally:
        if module is not None:
            sys.modules[name] = module
