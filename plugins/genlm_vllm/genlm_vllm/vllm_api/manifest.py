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


#: Every vLLM name genlm-vllm uses, each (path, name, feature) once and each attribute of a class in one
#: entry: classes with the attributes we read or write (methods we call or patch among them), functions
#: and methods with the parameters we pass by name or, for a method we override, the parameters it takes,
#: and the settings (environment variables) we set or read. Grouped by where vLLM defines them.
INTERFACES: tuple[Interface, ...] = (
    # ---- engines: vllm.LLM, AsyncLLM (vllm_api.client) ----
    Interface("entrypoints/llm.py", "LLM", attributes=("llm_engine",)),
    Interface("entrypoints/llm.py", "LLM.generate", ("prompts", "sampling_params", "lora_request", "use_tqdm")),
    Interface("entrypoints/llm.py", "LLM.collective_rpc", ("method", "args")),
    Interface("entrypoints/llm.py", "LLM.reset_prefix_cache"),
    Interface("v1/engine/llm_engine.py", "LLMEngine", attributes=("engine_core", "input_processor", "vllm_config")),
    Interface("v1/engine/llm_engine.py", "LLMEngine.remove_lora", ("lora_id",)),
    Interface("v1/engine/llm_engine.py", "LLMEngine.get_supported_tasks"),
    Interface("v1/engine/async_llm.py", "AsyncLLM", attributes=("engine_core", "vllm_config")),
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
    # ---- engine arguments and configuration ----
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
            "additional_config",
            "create_engine_config",
        ),
    ),
    Interface("engine/arg_utils.py", "AsyncEngineArgs"),
    Interface(
        "config/vllm.py",
        "VllmConfig",
        attributes=(
            "model_config",
            "cache_config",
            "scheduler_config",
            "parallel_config",
            "kv_transfer_config",
            "additional_config",
            "use_v2_model_runner",
        ),
    ),
    Interface("config/cache.py", "CacheConfig", attributes=("num_gpu_blocks", "block_size")),
    Interface(
        "config/scheduler.py",
        "SchedulerConfig",
        attributes=("max_num_batched_tokens", "max_num_seqs", "async_scheduling"),
    ),
    Interface("config/model.py", "ModelConfig", attributes=("max_model_len", "get_vocab_size", "dtype")),
    Interface("config/parallel.py", "ParallelConfig", attributes=("placement_group",)),
    Interface(
        "config/kv_transfer.py", "KVTransferConfig", attributes=("kv_connector", "kv_connector_module_path", "kv_role")
    ),
    Interface("platforms/__init__.py", "current_platform"),
    Interface("platforms/interface.py", "Platform.is_cpu"),
    Interface("envs.py", "disable_envs_cache"),
    # the settings genlm-vllm sets for an engine's processes or reads in them (vllm_api.release)
    Interface("envs.py", "VLLM_USE_V2_MODEL_RUNNER"),
    Interface("envs.py", "VLLM_USE_FLASHINFER_SAMPLER"),
    Interface("envs.py", "VLLM_ENABLE_V1_MULTIPROCESSING"),
    Interface("envs.py", "VLLM_WORKER_MULTIPROC_METHOD"),
    Interface("envs.py", "VLLM_CPU_OMP_THREADS_BIND"),
    Interface("envs.py", "VLLM_HOST_IP"),
    # how the engine's processes start: every module that holds get_mp_context (vllm_api.client)
    Interface("utils/system_utils.py", "get_mp_context"),
    Interface("v1/engine/utils.py", "get_mp_context"),
    Interface("v1/executor/multiproc_executor.py", "get_mp_context"),
    Interface("v1/engine/coordinator.py", "get_mp_context"),
    Interface("v1/worker/cpu_worker.py", "CPUWorker"),
    # ---- requests: prompts, parameters, outputs, adapters ----
    Interface("inputs/__init__.py", "TokensPrompt", attributes=("prompt_token_ids", "cache_salt")),
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
    # what generate returns: sample, top_logprobs and the async engine read it
    Interface("outputs.py", "RequestOutput", attributes=("outputs",)),
    Interface("outputs.py", "CompletionOutput", attributes=("token_ids", "logprobs")),
    Interface("logprobs.py", "Logprob", attributes=("logprob",)),
    # ---- the engine core, driven directly: sessions and resident requests (vllm_api.client) ----
    Interface(
        "v1/engine/input_processor.py",
        "InputProcessor.process_inputs",
        ("request_id", "prompt", "params", "supported_tasks", "lora_request", "resumable"),
    ),
    Interface("v1/engine/__init__.py", "EngineCoreRequest", attributes=("resumable", "external_req_id")),
    Interface("v1/engine/__init__.py", "EngineCoreOutputs", attributes=("outputs",)),
    Interface(
        "v1/engine/__init__.py",
        "EngineCoreOutput",
        attributes=("request_id", "new_token_ids", "finish_reason", "prefill_stats"),
    ),
    Interface(
        "v1/metrics/stats.py",
        "PrefillStats",
        attributes=("num_computed_tokens", "num_local_cached_tokens", "num_external_cached_tokens"),
    ),
    Interface("v1/engine/core_client.py", "EngineCoreClient.get_output"),
    Interface("v1/engine/core_client.py", "EngineCoreClient.add_request", ("request",)),
    Interface("v1/engine/core_client.py", "EngineCoreClient.abort_requests", ("request_ids",)),
    Interface("v1/engine/core_client.py", "EngineCoreClient.shutdown"),
    Interface("v1/engine/core_client.py", "InprocClient", attributes=("engine_core",)),
    Interface("v1/engine/core.py", "EngineCore", attributes=("scheduler", "model_executor", "batch_queue")),
    Interface("v1/executor/uniproc_executor.py", "UniProcExecutor", attributes=("driver_worker",)),
    Interface("v1/worker/worker_base.py", "WorkerWrapperBase", attributes=("worker",)),
    Interface("v1/worker/gpu_worker.py", "Worker", attributes=("model_runner",)),
    Interface(
        "v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        attributes=(
            "requests",
            "input_batch",
            "use_async_scheduling",
            "speculative_config",
            # read by the pipeline fix (vllm_api.fixes)
            "model",
            "model_config",
            "device",
            "max_num_tokens",
            "intermediate_tensors",
        ),
    ),
    Interface("v1/worker/gpu_input_batch.py", "InputBatch", attributes=("token_ids_cpu", "req_id_to_index")),
    Interface(
        "v1/worker/gpu_input_batch.py",
        "CachedRequestState",
        attributes=("output_token_ids", "sampling_params", "num_tokens"),
    ),
    # the scheduler's requests: resident requests (vllm_api.client) and the fork connector (vllm_api.worker)
    Interface(
        "v1/core/sched/scheduler.py",
        "Scheduler",
        attributes=("running", "requests", "hash_block_size", "_update_request_as_session"),
    ),
    Interface("v1/core/sched/scheduler.py", "Scheduler._update_request_as_session", ("session", "update")),
    Interface(
        "v1/request.py",
        "Request",
        attributes=(
            "request_id",
            "sampling_params",
            "lora_request",
            "num_computed_tokens",
            "all_token_ids",
            "block_hashes",
            "update_block_hashes",
            "_output_token_ids",
            "_all_token_ids",
            "num_prompt_tokens",
            "num_tokens",
            "is_finished",
        ),
    ),
    # ---- the two logits-processor interfaces (in_engine.capture; the batch read in vllm_api.worker) ----
    Interface("v1/sample/logits_processor/interface.py", "LogitsProcessor", subclassed=True),
    Interface(
        "v1/sample/logits_processor/interface.py",
        "LogitsProcessor.__init__",
        ("vllm_config", "device", "is_pin_memory"),
    ),
    Interface("v1/sample/logits_processor/interface.py", "LogitsProcessor.apply", ("logits",)),
    Interface("v1/sample/logits_processor/interface.py", "LogitsProcessor.update_state", ("batch_update",)),
    Interface("v1/sample/logits_processor/interface.py", "LogitsProcessor.is_argmax_invariant"),
    Interface("v1/sample/logits_processor/interface.py", "BatchUpdate", attributes=("removed", "added", "moved")),
    Interface("v1/sample/logits_processor/interface.py", "MoveDirectionality", attributes=("SWAP",)),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor",
        subclassed=True,
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor.__init__",
        ("vllm_config", "req_states"),
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor.add_request",
        ("req_idx", "sampling_params"),
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcessor.apply",
        ("logits", "ctx"),
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsContext",
        attributes=("expanded_idx_mapping", "pos", "idx_mapping_np"),
        feature="v2-logits-processors",
    ),
    Interface(
        "v1/worker/gpu/sample/logits_processor/interface.py",
        "LogitsProcRequestState",
        attributes=("all_token_ids", "prefill_len"),
        feature="v2-logits-processors",
    ),
    Interface("v1/worker/gpu/buffer_utils.py", "UvaBackedTensor", attributes=("np",), feature="v2-logits-processors"),
    Interface(
        "v1/worker/gpu/buffer_utils.py", "StagedWriteTensor", attributes=("gpu",), feature="v2-logits-processors"
    ),
    # ---- the fork connector (in_engine.forks; what it reads in vllm_api.worker) ----
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1", subclassed=True),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.__init__",
        ("vllm_config", "role", "kv_cache_config"),
    ),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1._get_connector_metadata"),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1.on_new_request", ("request",)),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.request_finished",
        ("request", "block_ids"),
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.get_num_new_matched_tokens",
        ("request", "num_computed_tokens"),
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
        "distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1.register_kv_caches", ("kv_caches",)
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1.start_load_kv", ("forward_context",)
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1.wait_for_layer_load", ("layer_name",)
    ),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.save_kv_layer",
        ("layer_name", "kv_layer", "attn_metadata"),
    ),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1.wait_for_save"),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1",
        attributes=("_kv_cache_manager",),
        feature="connector-cache-manager",
    ),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "SupportsHMA", subclassed=True),
    Interface(
        "distributed/kv_transfer/kv_connector/v1/base.py",
        "SupportsHMA.request_finished_all_groups",
        ("request", "block_ids"),
    ),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorMetadata", subclassed=True),
    Interface("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorRole", attributes=("SCHEDULER",)),
    Interface("v1/kv_cache_interface.py", "KVCacheConfig", attributes=("num_blocks", "kv_cache_groups")),
    Interface("v1/core/kv_cache_utils.py", "KVCacheBlockCopy", attributes=("src_block_id", "dst_block_id")),
    Interface(
        "v1/core/kv_cache_manager.py",
        "KVCacheManager.get_block_ids",
        ("request_id",),
        feature="connector-cache-manager",
    ),
    Interface("v1/core/kv_cache_manager.py", "KVCacheBlocks.get_block_ids"),
    Interface("v1/core/sched/output.py", "SchedulerOutput", attributes=("scheduled_cached_reqs",)),
    Interface(
        "v1/core/sched/output.py", "CachedRequestData", attributes=("req_ids", "resumed_req_ids", "new_block_ids")
    ),
    Interface(
        "v1/worker/utils.py", "copy_kv_cache_blocks_inplace", ("kv_caches", "num_blocks", "kv_cache_block_copies")
    ),
    # ---- parallel groups and how workers wait (vllm_api.worker) ----
    Interface("distributed/parallel_state.py", "get_tp_group"),
    Interface("distributed/parallel_state.py", "get_pp_group"),
    Interface(
        "distributed/parallel_state.py",
        "GroupCoordinator",
        attributes=("rank_in_group", "is_last_rank", "world_size", "device_communicator"),
    ),
    Interface("distributed/device_communicators/cpu_communicator.py", "CpuCommunicator", attributes=("dist_module",)),
    Interface("distributed/device_communicators/cpu_communicator.py", "_CPUSHMDistributed"),
    Interface(
        "distributed/device_communicators/shm_broadcast.py",
        "SpinCondition",
        attributes=("wait", "is_reader", "last_read", "busy_loop_s"),
    ),
    Interface("distributed/device_communicators/shm_broadcast.py", "SpinCondition.wait", ("timeout_ms",)),
    # ---- what vllm_api.fixes patches on the CPU build (vllm_api.worker.cpu_fix_targets) ----
    Interface(
        "lora/ops/torch_ops/lora_ops.py",
        "bgmv_shrink",
        ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"),
    ),
    Interface("lora/punica_wrapper/punica_cpu.py", "bgmv_shrink"),  # imported by name there: patched there too
    Interface(
        "v1/worker/cpu_model_runner.py",
        "CPUModelRunner.sync_and_gather_intermediate_tensors",
        ("num_tokens", "intermediate_tensors", "sync_self"),
    ),
    Interface(
        "model_executor/models/interfaces.py",
        "SupportsPP.make_empty_intermediate_tensors",
        ("batch_size", "dtype", "device"),
    ),
)
