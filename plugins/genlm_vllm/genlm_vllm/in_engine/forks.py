"""Forks share their parent's unfinished KV block: a vLLM KV connector that copies it on the device.

After resampling, several particles continue one context. One continues the parent's live session
(:mod:`genlm_vllm.live`); every other child starts a session of its own. vLLM's prefix cache
serves the child's *full* blocks, but caches no block until it is full, so without help each child
would recompute the parent's unfinished last block (up to a block less one token).

:class:`ForkConnector` is plugged in through vLLM's own extension point for loading KV from
elsewhere (a KV connector, ``kv_transfer_config``). For a new request whose ``extra_args`` name a
parent (:data:`FORK`), the scheduler side

1. checks that the parent is still in the engine, has computed at least the child's context less
   its last token, and holds exactly those tokens (a mismatch loads nothing: the child recomputes);
2. tells the scheduler that these tokens, beyond the child's block-aligned prefix-cache hit, are
   "external";
3. once the child's blocks are allocated, pairs each of the parent's blocks in that range with the
   child's.

Each worker then copies those blocks, in every layer it holds, before the step's forward pass (vLLM's
own in-place block copy, the one its sub-block prefix hits use). The parent's positions below its
context length are never written again, and the copy runs in the same step as it is planned, so the
parent's blocks cannot be freed in between. vLLM imports this module by name
(:data:`~genlm_vllm.transport.keys.CONNECTOR_MODULE`) wherever its scheduler or workers run (the engine-core
process, each TP/PP or Ray worker); importing it changes nothing. The caller plugs it in with
:func:`genlm_vllm.start.engine_args.engine_kwargs` and names a request's parent with
:data:`~genlm_vllm.transport.keys.FORK`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from genlm_vllm.transport.keys import FORK
from genlm_vllm.vllm_api import worker
from genlm_vllm.vllm_api.release import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA


@dataclass
class ForkCopies(KVConnectorMetadata):
    """One step's block copies, vLLM's ``KVCacheBlockCopy`` of ``(parent block, child block)``, for the workers."""

    copies: list[Any] = field(default_factory=list)


@dataclass
class _Planned:
    parent: str
    start: int  # first token the child loads (block-aligned: its prefix-cache hit)
    end: int  # one past the last


class ForkConnector(KVConnectorBase_V1, SupportsHMA):
    """Copies a parent's KV blocks into a forked child's, so the child computes only its new token.

    It declares support for vLLM's hybrid KV cache manager so that plugging it in changes nothing for
    hybrid or sliding-window models (vLLM would otherwise turn that manager off); on those, with
    several KV cache groups, it loads nothing and forks use the prefix cache alone."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        setup = worker.connector_setup(vllm_config, role, kv_cache_config)
        self.block_size = setup.block_size
        self.num_blocks = setup.blocks
        # One KV cache group (plain attention): hybrid models keep prefix caching only.
        self.enabled = setup.groups == 1
        self._requests: dict[str, Any] = {}  # every request in the scheduler, by id (scheduler side)
        self._planned: dict[str, _Planned] = {}
        self._copies: list[Any] = []  # vLLM's KVCacheBlockCopy of each block to copy this step
        self._blocks = worker.ConnectorBlocks()  # every request's block ids, however this vLLM exposes them
        self._kv_caches: list[Any] = []  # worker side
        if setup.scheduler_side:
            worker.exact_session_block_hashes()  # this process runs the scheduler: sessions resume with exact hashes

    # ---- scheduler side ----

    def on_new_request(self, request: Any) -> None:
        self._requests[worker.request_key(request)] = request

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        key = worker.request_key(request)
        self._requests.pop(key, None)
        self._planned.pop(key, None)
        self._blocks.finished(key)
        return False, None  # nothing held: vLLM frees the blocks now

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        key, args, length = worker.fork_wanted(request)
        self._planned.pop(key, None)
        parent_id = args.get(FORK)
        if parent_id is None or not self.enabled:
            return 0, False
        parent = self._requests.get(parent_id)
        end = length - 1  # the child computes at least its last token itself
        if parent is None or end <= num_computed_tokens or not worker.holds_prefix(parent, request, end):
            return 0, False
        self._planned[key] = _Planned(parent_id, num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        key = worker.request_key(request)
        if self.enabled:
            self._blocks.allocated(self, key, blocks)
        plan = self._planned.pop(key, None)
        if plan is None or num_external_tokens == 0:
            return
        assert plan.end - plan.start == num_external_tokens
        first, last = plan.start // self.block_size, (plan.end - 1) // self.block_size
        parent_blocks = self._blocks.of(self, plan.parent)
        child_blocks = worker.allocated_block_ids(blocks)
        # Preemption frees blocks only before new requests are scheduled, and then none is.
        assert len(parent_blocks) > last and len(child_blocks) > last, "fork: a block is missing"
        self._copies.extend(worker.block_copies((parent_blocks[i], child_blocks[i]) for i in range(first, last + 1)))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.enabled:
            self._blocks.scheduled(self, scheduler_output)
        meta, self._copies = ForkCopies(self._copies), []
        return meta

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = list(kv_caches.values())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = worker.connector_metadata(self)
        if isinstance(meta, ForkCopies) and meta.copies:
            worker.copy_kv_blocks(self._kv_caches, self.num_blocks, meta.copies)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
