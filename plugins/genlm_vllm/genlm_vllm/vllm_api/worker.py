"""vLLM inside the model's processes: parallel groups, how workers wait, KV block copies, the
scheduler's block ids and hashes, and the CPU build's objects that :mod:`~genlm_vllm.vllm_api.fixes`
patches. Used by the engine-side code (:mod:`genlm_vllm.in_engine`). Imports no vLLM at import.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from genlm_vllm.vllm_api import release

# ---- inside the model's processes ---------------------------------------------------------------


def parallel_ranks() -> tuple[Any, Any] | None:
    """(tensor-parallel group, pipeline-parallel group) of this worker, or None outside vLLM's groups."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group(), get_pp_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None


def group_path(group: Any) -> str:
    """How a process group talks: on CPU "shm" (vLLM's shared-memory collectives) or
    "torch.distributed" (the network path); elsewhere the communicator's class name."""
    communicator = getattr(group, "device_communicator", None)
    if type(communicator).__name__ != "CpuCommunicator":
        return type(communicator).__name__
    shm = type(getattr(communicator, "dist_module", None)).__name__ == "_CPUSHMDistributed"
    return "shm" if shm else "torch.distributed"


def nap_while_waiting(seconds: float) -> bool:
    """In this process, a reader of vLLM's shared-memory message queues (a worker waiting for the
    engine's next step) sleeps ``seconds`` between checks for its next message, where vLLM spins
    (``sched_yield`` in a loop) for its first second after each message. After that second both wait
    as vLLM does: for the writer's notification. Idempotent; the last ``seconds`` holds. Returns
    False where this vLLM has no such queue (nothing is changed then)."""
    global _nap_s
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    if _nap_s is None:
        spin_wait = SpinCondition.wait

        def wait(self: Any, timeout_ms: int | None = None) -> None:
            if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
                time.sleep(_nap_s or 0.0)  # where vLLM calls sched_yield(): a core kept busy
                return
            spin_wait(self, timeout_ms)

        setattr(SpinCondition, "wait", wait)  # noqa: B010 (mypy: a method)
    _nap_s = seconds
    return True


_nap_s: float | None = None  #: the nap of nap_while_waiting, once it has patched this process


def copy_kv_blocks(kv_caches: list[Any], num_blocks: int, copies: list[Any]) -> None:
    """vLLM's in-place KV block copy (every layer), on the worker."""
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies)


class ConnectorBlocks:
    """The KV block ids the scheduler holds for each request, as a KV connector on the scheduler
    side can know them (single KV cache group).

    Where vLLM binds its KV cache manager to the connector (``bind_kv_cache_manager``, vLLM 0.32 on),
    they are read there, and nothing is kept. Where it does not (0.26, whose connectors get the block
    pool only), they are kept from what the scheduler tells every connector: a request's whole block
    list each time it is scheduled from the waiting queue (:meth:`allocated`, from
    ``update_state_after_alloc``: new requests, resumed sessions, preempted requests), and each step's
    new blocks of running requests (:meth:`scheduled`, from the step's ``SchedulerOutput``: appended,
    or replacing the list for a request resumed from preemption). A connector plans a copy only from
    blocks that hold tokens computed in earlier steps, so the blocks a running request gets in the
    step being scheduled (reported at its end) are never needed before they are known."""

    def __init__(self) -> None:
        self._ids: dict[str, list[int]] = {}

    @staticmethod
    def _manager(connector: Any) -> Any:
        return getattr(connector, "_kv_cache_manager", None)

    def allocated(self, connector: Any, request_id: str, blocks: Any) -> None:
        """``update_state_after_alloc``'s blocks (every block of the request)."""
        if self._manager(connector) is None:
            self._ids[request_id] = list(blocks.get_block_ids()[0])

    def scheduled(self, connector: Any, scheduler_output: Any) -> None:
        """A step's new blocks of running and resumed requests (``build_connector_meta``'s output)."""
        if self._manager(connector) is not None:
            return
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for request_id, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new is None:
                continue
            if request_id in resumed:
                self._ids[request_id] = list(new[0])
            elif (known := self._ids.get(request_id)) is not None:
                known.extend(new[0])

    def finished(self, request_id: str) -> None:
        self._ids.pop(request_id, None)

    def of(self, connector: Any, request_id: str) -> list[int]:
        """The block ids of a request in the scheduler (empty if it holds none)."""
        manager = self._manager(connector)
        if manager is not None:
            return list(manager.get_block_ids(request_id)[0])
        return list(self._ids.get(request_id, ()))


def exact_session_block_hashes() -> None:
    """Make vLLM's scheduler (in this process) drop a resumed session's block hashes past its computed
    tokens and hash those blocks again, once per process.

    A session's chunk samples one token that genlm discards: when the next chunk arrives, vLLM replaces
    it with the chunk's tokens. vLLM 0.32 on also drops the hashes of blocks that held it; vLLM 0.26 keeps
    them, so a block that the discarded token completed would enter the prefix cache under the hash of
    tokens it does not hold, and a later context with that token would be served another token's KV.
    Applied on every release: where vLLM drops them itself, hashing the same tokens again gives the same
    hashes. Called where the scheduler lives (the fork connector's scheduler side)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_request_as_session
    if getattr(original, "genlm_exact_hashes", False):
        return

    @functools.wraps(original)
    def update_session(self: Any, session: Any, update: Any) -> None:
        computed = session.num_computed_tokens
        original(self, session, update)
        hash_again_past(session, computed, self.hash_block_size)

    update_session.genlm_exact_hashes = True  # type: ignore[attr-defined]
    setattr(Scheduler, "_update_request_as_session", update_session)  # noqa: B010 (mypy: a method)


def hash_again_past(request: Any, computed: int, block_size: int) -> None:
    """Drop a request's block hashes past its first ``computed`` tokens' whole blocks (those never
    change) and hash those blocks again from the tokens it holds now."""
    keep = computed // block_size
    if len(request.block_hashes) > keep:
        del request.block_hashes[keep:]
        request.update_block_hashes()


def connector_metadata(connector: Any) -> Any:
    """This step's metadata bound to a connector on the worker side."""
    return connector._get_connector_metadata()


def cpu_fix_targets() -> dict[str, Any] | None:
    """The vLLM objects :mod:`genlm_vllm.vllm_api.fixes` patches on the CPU build (None elsewhere)."""
    if not release.on_cpu_build():
        return None
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return {"lora_ops": lora_ops, "punica_cpu": punica_cpu, "cpu_runner": CPUModelRunner}
