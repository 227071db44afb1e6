"""vLLM inside the model's processes: parallel groups, how workers wait, what the logits processors read
of a step's batch, what the fork connector reads of the scheduler's requests and blocks, KV block copies,
the scheduler's block hashes, and the CPU build's objects that :mod:`~genlm_vllm.vllm_api.fixes` patches.

Every attribute the engine-side code (:mod:`genlm_vllm.in_engine`) reads of a vLLM object is read here,
by an accessor that takes the whole object and returns plain values, once per step or per request (not
per row). Imports no vLLM at import.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

from genlm_vllm.vllm_api import release

# ---- inside the model's processes ---------------------------------------------------------------


@dataclass(frozen=True)
class Place:
    """Where this worker sits in vLLM's tensor- and pipeline-parallel groups (``GroupCoordinator``s)."""

    tp_rank: int  #: its rank in the tensor-parallel group
    pp_rank: int  #: its rank in the pipeline-parallel group
    last_stage: bool  #: whether it runs the pipeline's last stage


def _groups() -> tuple[Any, Any] | None:
    """(tensor-parallel group, pipeline-parallel group) of this worker, or None outside vLLM's groups."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group(), get_pp_group()
    except (AssertionError, AttributeError, RuntimeError):
        return None


def parallel_place() -> Place | None:
    """This worker's :class:`Place` in vLLM's groups, or None outside them (a single process). Read
    each time the capture asks whether this process writes rows: only the ranks."""
    groups = _groups()
    if groups is None:
        return None
    tp, pp = groups
    return Place(tp_rank=tp.rank_in_group, pp_rank=pp.rank_in_group, last_stage=pp.is_last_rank)


def group_paths() -> tuple[str | None, str | None]:
    """How this worker's tensor- and pipeline-parallel groups talk (:func:`group_path`; None for a group
    of one, or outside vLLM's groups): for reports, not for each step."""
    groups = _groups()
    if groups is None:
        return None, None
    tp, pp = groups
    return (group_path(tp) if tp.world_size > 1 else None, group_path(pp) if pp.world_size > 1 else None)


def group_path(group: Any) -> str:
    """How a process group talks: on CPU "shm" (vLLM's shared-memory collectives) or
    "torch.distributed" (the network path); elsewhere the communicator's class name."""
    communicator = getattr(group, "device_communicator", None)
    if type(communicator).__name__ != "CpuCommunicator":
        return type(communicator).__name__
    shm = type(getattr(communicator, "dist_module", None)).__name__ == "_CPUSHMDistributed"
    return "shm" if shm else "torch.distributed"


def engine_settings(vllm_config: Any) -> dict[str, Any] | None:
    """The ``additional_config`` a ``VllmConfig`` was started with (None: none, or not a dict)."""
    settings = getattr(vllm_config, "additional_config", None)
    return settings if isinstance(settings, dict) else None


def node_address() -> str | None:
    """The address vLLM was told this node has (``VLLM_HOST_IP``), if any."""
    return os.environ.get(release.HOST_IP_VARIABLE) or None


# ---- the logits processors' view of a batch (genlm_vllm.in_engine.capture) ---------------------------


def request_args(sampling_params: Any) -> dict[str, Any]:
    """A request's ``SamplingParams.extra_args`` ({} for none, or no parameters)."""
    return (sampling_params.extra_args or {}) if sampling_params is not None else {}


def batch_changes(
    batch_update: Any,
) -> tuple[Any, list[tuple[int, dict[str, Any], Any, Any]], list[tuple[int, int, bool]]]:
    """A V1 ``BatchUpdate`` as ``(removed indices, added, moved)``: added as ``(index, extra args,
    prompt ids, output ids)`` (the id lists are the runner's own), moved as ``(from, to, swapped)``."""
    swap = release.loaded().MoveDirectionality.SWAP
    added = [(index, request_args(params), prompt, output) for index, params, prompt, output in batch_update.added]
    moved = [(a, b, direction == swap) for a, b, direction in batch_update.moved]
    return batch_update.removed, added, moved


def prefill_length(req_states: Any, slot: int) -> int:
    """Model Runner V2: the tokens a request in ``slot`` was (re)filled with (``prefill_len``)."""
    return int(req_states.prefill_len.np[slot])


def token_history(req_states: Any) -> Any:
    """Model Runner V2: every request slot's token ids, on the device (``all_token_ids``)."""
    return req_states.all_token_ids.gpu


def step_slots(ctx: Any) -> Any:
    """Model Runner V2: the request slots of a step's ``LogitsContext`` (a host array, one per request)."""
    return ctx.idx_mapping_np


def step_rows(ctx: Any) -> tuple[list[int], list[int]]:
    """Model Runner V2: each logits row's request slot and position, of a step's ``LogitsContext``."""
    return ctx.expanded_idx_mapping.tolist(), ctx.pos.tolist()


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


# ---- the fork connector's view of the scheduler (genlm_vllm.in_engine.forks) ----------------------


@dataclass(frozen=True)
class ConnectorSetup:
    """What a KV connector is built with, read from vLLM's configuration."""

    block_size: int  #: tokens per KV block (``cache_config.block_size``)
    blocks: int  #: KV blocks in the cache (``KVCacheConfig.num_blocks``)
    groups: int  #: KV cache groups (one for plain attention; more for hybrid models)
    scheduler_side: bool  #: whether this instance is the scheduler's (``KVConnectorRole.SCHEDULER``)


def connector_setup(vllm_config: Any, role: Any, kv_cache_config: Any) -> ConnectorSetup:
    """A KV connector's :class:`ConnectorSetup` from its constructor's arguments."""
    return ConnectorSetup(
        block_size=vllm_config.cache_config.block_size,
        blocks=kv_cache_config.num_blocks,
        groups=len(kv_cache_config.kv_cache_groups),
        scheduler_side=role == release.loaded().KVConnectorRole.SCHEDULER,
    )


def request_key(request: Any) -> str:
    """A scheduler ``Request``'s id."""
    return str(request.request_id)


def fork_wanted(request: Any) -> tuple[str, dict[str, Any], int]:
    """A new scheduler ``Request``'s ``(id, extra args, tokens it holds)`` ({} for no extra args)."""
    return request_key(request), request_args(request.sampling_params), request.num_tokens


def holds_prefix(parent: Any, child: Any, end: int) -> bool:
    """Whether scheduler request ``parent`` has computed at least ``end`` tokens, holds the same first
    ``end`` tokens as ``child`` and runs with the same LoRA adapter."""
    return (
        parent.lora_request == child.lora_request
        and parent.num_computed_tokens >= end
        and parent.all_token_ids[:end] == child.all_token_ids[:end]
    )


def block_copies(pairs: Any) -> list[Any]:
    """vLLM's ``KVCacheBlockCopy`` of each ``(source block, target block)``."""
    copy = release.loaded().KVCacheBlockCopy
    return [copy(src_block_id=source, dst_block_id=target) for source, target in pairs]


def allocated_block_ids(blocks: Any) -> list[int]:
    """The block ids of ``update_state_after_alloc``'s ``KVCacheBlocks`` (one KV cache group)."""
    (ids,) = blocks.get_block_ids()
    return list(ids)


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
