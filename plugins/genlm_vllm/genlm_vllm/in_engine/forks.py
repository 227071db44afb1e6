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
from genlm_vllm.vllm_api.release import (
    KVCacheBlockCopy,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from genlm_vllm.vllm_api.worker import ConnectorBlocks, connector_metadata, copy_kv_blocks, exact_session_block_hashes


@dataclass
class ForkCopies(KVConnectorMetadata):
    """One step's block copies, ``(parent block, child block)``, for the workers."""

    copies: list[KVCacheBlockCopy] = field(default_factory=list)


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
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        # One KV cache group (plain attention): hybrid models keep prefix caching only.
        self.enabled = len(kv_cache_config.kv_cache_groups) == 1
        self._requests: dict[str, Any] = {}  # every request in the scheduler, by id (scheduler side)
        self._planned: dict[str, _Planned] = {}
        self._copies: list[KVCacheBlockCopy] = []
        self._blocks = ConnectorBlocks()  # every request's block ids, however this vLLM exposes them
        self._kv_caches: list[Any] = []  # worker side
        if role == KVConnectorRole.SCHEDULER:
            exact_session_block_hashes()  # this process runs the scheduler: sessions resume with exact hashes

    # ---- scheduler side ----

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        self._blocks.finished(request.request_id)
        return False, None  # nothing held: vLLM frees the blocks now

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._planned.pop(request.request_id, None)
        args = request.sampling_params.extra_args if request.sampling_params is not None else None
        parent_id = args.get(FORK) if args else None
        if parent_id is None or not self.enabled:
            return 0, False
        parent = self._requests.get(parent_id)
        end = request.num_tokens - 1  # the child computes at least its last token itself
        if (
            parent is None
            or parent.lora_request != request.lora_request
            or parent.num_computed_tokens < end
            or end <= num_computed_tokens
            or parent.all_token_ids[:end] != request.all_token_ids[:end]
        ):
            return 0, False
        self._planned[request.request_id] = _Planned(parent_id, num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.enabled:
            self._blocks.allocated(self, request.request_id, blocks)
        plan = self._planned.pop(request.request_id, None)
        if plan is None or num_external_tokens == 0:
            return
        assert plan.end - plan.start == num_external_tokens
        first, last = plan.start // self.block_size, (plan.end - 1) // self.block_size
        parent_blocks = self._blocks.of(self, plan.parent)
        (child_blocks,) = blocks.get_block_ids()
        # Preemption frees blocks only before new requests are scheduled, and then none is.
        assert len(parent_blocks) > last and len(child_blocks) > last, "fork: a block is missing"
        self._copies.extend(KVCacheBlockCopy(parent_blocks[i], child_blocks[i]) for i in range(first, last + 1))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.enabled:
            self._blocks.scheduled(self, scheduler_output)
        meta, self._copies = ForkCopies(self._copies), []
        return meta

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = list(kv_caches.values())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = connector_metadata(self)
        if isinstance(meta, ForkCopies) and meta.copies:
            copy_kv_blocks(self._kv_caches, self.num_blocks, meta.copies)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
