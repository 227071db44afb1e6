"""The manifest: every vLLM name genlm-vllm relies on, with the parameters we pass and the attributes
we read, checked against each release's own sources by :mod:`genlm_vllm.tools.contract` (CUDA wheels
included, which cannot run here), and the :data:`FEATURES` some supported releases lack.
"""

from __future__ import annotations

from dataclasses import dataclass

from genlm_vllm.vllm_api.release import V2_PROCESSORS_MODULE

# ---- what the contract test checks in each release's sources --------------------------------------


@dataclass(frozen=True)
class Interface:
    """A vLLM name we rely on: a class, function or method in a source file, the parameters we pass
    it (by name) and, for classes, the attributes we read."""

    path: str  #: under the ``vllm`` package, e.g. ``"v1/engine/input_processor.py"``
    name: str  #: ``"Class"``, ``"function"`` or ``"Class.method"``
    parameters: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    subclassed: bool = False  #: we subclass it: the contract test checks its abstract methods
    #: "": always needed; "name": needed where the release has :data:`FEATURES` ``name``; "!name":
    #: needed where it lacks it (what genlm-vllm uses instead)
    feature: str = ""


@dataclass(frozen=True)
class Feature:
    """A part of vLLM's internals that some supported releases lack, and what genlm-vllm does there."""

    path: str  #: where the marker is defined, under the ``vllm`` package
    marker: str  #: the release has the feature if and only if it has this name
    without: str  #: what genlm-vllm does on a release without it
    modules: tuple[str, ...] = ()  #: modules this module imports only where the release has it


FEATURES: dict[str, Feature] = {
    "v2-logits-processors": Feature(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor",
        "the V1 model runner captures rows (Model Runner V2 takes no logits processors): resolve_runner",
        (V2_PROCESSORS_MODULE,),
    ),
    "utility-all": Feature(
        "v1/engine/core_client.py",
        "AsyncMPClient.call_utility_all_async",
        "data-parallel collective_rpc through the client's per-engine utility call: utility_on_every_engine",
    ),
    "connector-cache-manager": Feature(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.bind_kv_cache_manager",
        "the fork connector keeps each request's block ids from the scheduler's calls: ConnectorBlocks",
    ),
}


INTERFACES: tuple[Interface, ...] = (
    Interface("entrypoints/llm.py", "LLM.generate", ("prompts", "sampling_params", "lora_request", "use_tqdm")),
    Interface("entrypoints/llm.py", "LLM.collective_rpc", ("method", "args")),
    Interface("entrypoints/llm.py", "LLM.reset_prefix_cache"),
    Interface("v1/engine/llm_engine.py", "LLMEngine.remove_lora", ("lora_id",)),
    Interface("v1/engine/llm_engine.py", "LLMEngine.get_supported_tasks"),
    Interface(
        "v1/engine/async_llm.py", "AsyncLLM.generate", ("prompt", "sampling_params", "request_id", "lora_request")
    ),
    Interface("v1/engine/async_llm.py", "AsyncLLM.from_engine_args", ("engine_args",)),
    Interface("v1/engine/async_llm.py", "AsyncLLM.collective_rpc", ("method", "args")),
    Interface("v1/engine/async_llm.py", "AsyncLLM.reset_prefix_cache"),
    Interface("v1/engine/async_llm.py", "AsyncLLM.remove_lora", ("lora_id",)),
    Interface("v1/engine/async_llm.py", "AsyncLLM.shutdown"),
    Interface("v1/engine/core_client.py", "AsyncMPClient.call_utility_all_async", ("method",), feature="utility-all"),
    Interface(
        "v1/engine/core_client.py", "AsyncMPClient._call_utility_async", ("method", "engine"), feature="!utility-all"
    ),
    Interface("v1/engine/core_client.py", "MPClient", attributes=("core_engines",), feature="!utility-all"),
    Interface(
        "v1/engine/input_processor.py",
        "InputProcessor.process_inputs",
        ("request_id", "prompt", "params", "supported_tasks", "lora_request", "resumable"),
    ),
    Interface("v1/engine/__init__.py", "EngineCoreRequest", attributes=("resumable", "external_req_id")),
    Interface("v1/engine/__init__.py", "EngineCoreOutput", attributes=("request_id", "new_token_ids", "prefill_stats")),
    Interface(
        "v1/metrics/stats.py",
        "PrefillStats",
        attributes=("num_computed_tokens", "num_local_cached_tokens", "num_external_cached_tokens"),
    ),
    Interface("v1/engine/core_client.py", "EngineCoreClient.get_output"),
    Interface("v1/engine/core_client.py", "EngineCoreClient.add_request", ("request",)),
    Interface("v1/engine/core_client.py", "EngineCoreClient.abort_requests", ("request_ids",)),
    Interface("v1/engine/core_client.py", "EngineCoreClient.shutdown"),
    Interface("inputs/__init__.py", "TokensPrompt"),
    Interface(
        "sampling_params.py",
        "SamplingParams",
        attributes=(
            "n",
            "max_tokens",
            "temperature",
            "seed",
            "stop_token_ids",
            "ignore_eos",
            "detokenize",
            "logprobs",
            "extra_args",
        ),
    ),
    Interface("lora/request.py", "LoRARequest", attributes=("lora_name", "lora_int_id", "lora_path")),
    Interface(
        "engine/arg_utils.py",
        "EngineArgs",
        attributes=(
            "model",
            "dtype",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "logits_processors",
            "max_model_len",
            "block_size",
            "enable_lora",
            "max_lora_rank",
            "kv_transfer_config",
            "async_scheduling",
            "worker_extension_cls",
        ),
    ),
    Interface("entrypoints/llm.py", "LLM", attributes=("llm_engine",)),
    Interface("v1/engine/llm_engine.py", "LLMEngine", attributes=("engine_core", "input_processor", "vllm_config")),
    Interface("v1/engine/async_llm.py", "AsyncLLM", attributes=("engine_core", "vllm_config")),
    Interface(
        "config/vllm.py",
        "VllmConfig",
        attributes=("model_config", "cache_config", "scheduler_config", "parallel_config", "kv_transfer_config"),
    ),
    Interface("config/cache.py", "CacheConfig", attributes=("num_gpu_blocks", "block_size")),
    Interface(
        "config/scheduler.py",
        "SchedulerConfig",
        attributes=("max_num_batched_tokens", "max_num_seqs", "async_scheduling"),
    ),
    Interface("config/model.py", "ModelConfig", attributes=("max_model_len", "get_vocab_size")),
    Interface("config/parallel.py", "ParallelConfig", attributes=("placement_group",)),
    Interface("config/vllm.py", "VllmConfig.use_v2_model_runner"),
    Interface(
        "config/kv_transfer.py", "KVTransferConfig", attributes=("kv_connector", "kv_connector_module_path", "kv_role")
    ),
    Interface("platforms/interface.py", "Platform.is_cpu"),
    # what generate returns: sample, top_logprobs and the async engine read it
    Interface("outputs.py", "RequestOutput", attributes=("outputs",)),
    Interface("outputs.py", "CompletionOutput", attributes=("token_ids", "logprobs")),
    Interface("logprobs.py", "Logprob", attributes=("logprob",)),
    Interface("envs.py", "disable_envs_cache"),
    Interface("utils/system_utils.py", "get_mp_context"),
    Interface("engine/arg_utils.py", "EngineArgs.create_engine_config"),
    # the two logits-processor interfaces (genlm_vllm.in_engine.capture)
    Interface(
        "v1/sample/logits_processor/interface.py",
        "LogitsProcessor",
        attributes=("apply", "update_state", "is_argmax_invariant"),
        subclassed=True,
    ),
    Interface("v1/sample/logits_processor/interface.py", "BatchUpdate", attributes=("removed", "added", "moved")),
    Interface("v1/sample/logits_processor/interface.py", "MoveDirectionality", attributes=("SWAP",)),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor",
        attributes=("add_request", "apply"),
        subclassed=True,
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsContext",
        attributes=("expanded_idx_mapping", "pos"),
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcRequestState",
        attributes=("all_token_ids", "prefill_len"),
        feature="v2-logits-processors",
    ),
    # the fork connector (genlm_vllm.in_engine.forks)
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1", subclassed=True),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1._get_connector_metadata"),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "SupportsHMA", subclassed=True),
    Interface("v1/core/kv_cache_utils.py", "KVCacheBlockCopy"),
    Interface(
        "v1/core/kv_cache_manager.py",
        "KVCacheManager.get_block_ids",
        ("request_id",),
        feature="connector-cache-manager",
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1",
        attributes=("_kv_cache_manager",),
        feature="connector-cache-manager",
    ),
    Interface("v1/core/kv_cache_manager.py", "KVCacheBlocks.get_block_ids"),
    Interface("v1/core/sched/output.py", "SchedulerOutput", attributes=("scheduled_cached_reqs",)),
    Interface(
        "v1/core/sched/output.py", "CachedRequestData", attributes=("req_ids", "resumed_req_ids", "new_block_ids")
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.update_state_after_alloc",
        ("request", "blocks", "num_external_tokens"),
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.build_connector_meta",
        ("scheduler_output",),
    ),
    Interface(
        "v1/request.py",
        "Request",
        attributes=("request_id", "sampling_params", "lora_request", "num_computed_tokens", "all_token_ids"),
    ),
    Interface(
        "v1/worker/utils.py", "copy_kv_cache_blocks_inplace", ("kv_caches", "num_blocks", "kv_cache_block_copies")
    ),
    Interface("v1/core/sched/scheduler.py", "Scheduler._update_request_as_session", ("session", "update")),
    Interface("v1/core/sched/scheduler.py", "Scheduler", attributes=("hash_block_size",)),
    Interface("v1/request.py", "Request", attributes=("block_hashes", "update_block_hashes")),
    Interface(
        "distributed/device_communicators/shm_broadcast.py",
        "SpinCondition",
        attributes=("wait", "is_reader", "last_read", "busy_loop_s"),
    ),
    Interface("distributed/device_communicators/shm_broadcast.py", "SpinCondition.wait", ("timeout_ms",)),
    Interface("distributed/parallel_state.py", "get_tp_group"),
    Interface("distributed/parallel_state.py", "get_pp_group"),
    # resident requests (ResidentCore): the in-process core, its scheduler and the V1 runner's batch
    Interface("v1/engine/core_client.py", "InprocClient", attributes=("engine_core",)),
    Interface("v1/engine/core.py", "EngineCore", attributes=("scheduler", "model_executor", "batch_queue")),
    Interface("v1/executor/uniproc_executor.py", "UniProcExecutor", attributes=("driver_worker",)),
    Interface("v1/worker/worker_base.py", "WorkerWrapperBase", attributes=("worker",)),
    Interface("v1/worker/gpu_worker.py", "Worker", attributes=("model_runner",)),
    Interface(
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        attributes=("requests", "input_batch", "use_async_scheduling", "speculative_config"),
    ),
    Interface("v1/worker/gpu_input_batch.py", "InputBatch", attributes=("token_ids_cpu", "req_id_to_index")),
    Interface(
        "v1/worker/gpu_input_batch.py",
        "CachedRequestState",
        attributes=("output_token_ids", "sampling_params", "num_tokens"),
    ),
    Interface("v1/core/sched/scheduler.py", "Scheduler", attributes=("running", "requests")),
    Interface(
        "v1/request.py",
        "Request",
        attributes=("_output_token_ids", "_all_token_ids", "num_prompt_tokens", "num_tokens", "is_finished"),
    ),
)
