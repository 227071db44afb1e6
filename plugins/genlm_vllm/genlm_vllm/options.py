"""Options of the ``vllm`` backend."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from genlm_core.config import BackendOptions, LiveOptions  # import-light: registering the plugin imports no torch
from genlm_vllm.layout import layout

#: Batches in a row a parked session may go unclaimed before it is aborted, by default (a step's
#: particles may come in several batches: the ``"eager"`` flush policy, or a program that awaits
#: something else first).
MAX_IDLE_BATCHES = 4


class VLLMOptions(BackendOptions):
    """Options of the ``vllm`` backend. ``engine_opts`` go to vLLM's engine arguments unchanged
    (tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend, enforce_eager,
    kv_cache_memory_bytes, ...)."""

    batch_size: PositiveInt = Field(256, description="Most requests handed to the engine in one generate call.")
    dtype: str = Field("auto", description="Model dtype for vLLM ('auto', 'float32', 'bfloat16', ...).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory for the engine (on CPU builds: of RAM for the KV cache)."
    )
    max_model_len: PositiveInt | None = Field(None, description="Longest context the engine accepts.")
    enable_prefix_caching: bool = Field(True, description="vLLM's automatic prefix caching.")
    block_size: PositiveInt | None = Field(
        None,
        description="Tokens per KV block. Prefix caching reuses only whole blocks, so a context that extends no "
        "live sequence (see live) recomputes up to a block less one. None: the "
        "smallest block the engine accepts where vLLM's default is larger (32 on vLLM's CPU build, whose default "
        "is 128), else vLLM's default (16 on CUDA). engine_opts['block_size'] overrides it.",
    )
    live: LiveOptions = Field(
        default_factory=lambda: LiveOptions.model_validate({"max_idle_batches": MAX_IDLE_BATCHES}),
        description="Keep each request's sequence alive in the engine (vLLM's resumable sessions, as core's live "
        "sequences) so that a request extending it by a few tokens (a particle's next step) computes only those "
        "tokens; siblings that fork it after resampling copy its unfinished KV block "
        "(genlm_vllm.in_engine.forks). Only for engine='llm'; enabled=False: every batch is a plain generate, "
        "with prefix caching only.",
    )
    resident_requests: bool = Field(
        True,
        description="With live sequences, keep a particle that continues by one token as a running vLLM request "
        "(its next input the token the program chose, written in place of the one vLLM sampled), so that a "
        "continued particle costs what vLLM's own decode of a token costs; forks and new contexts still add "
        "requests. Where the engine cannot (its core or model in other processes, Model Runner V2, async "
        "scheduling: the log says which), or False, each row is a chunk of a resumable session.",
    )
    rows_on_device: bool = Field(
        False,
        description="In-process engine on an accelerator: rows stay on the model's device, where the program's "
        "tries and proposals can read them (else each step's rows come to the host in one copy).",
    )
    enable_lora: bool = Field(False, description="Allow LoRA adapters (load_lora / set_lora).")
    max_lora_rank: PositiveInt = Field(16, description="Largest LoRA rank the engine reserves room for.")
    engine: Literal["llm", "async"] = Field(
        "llm",
        description="'llm': vllm.LLM, one generate per batch of the AutoBatcher (fastest on a small machine); "
        "'async': vLLM's AsyncLLM, every request streams into the running engine as it comes, no batch barrier.",
    )
    multiprocess: bool | None = Field(
        None,
        description="Run vLLM's engine core in a process of its own (vLLM's default). None: no for 'llm' "
        "(in-process is faster on few cores), yes for 'async' (AsyncLLM always does).",
    )
    start_method: Literal["auto", "spawn", "forkserver"] = Field(
        "auto",
        description="How the engine's own processes start (its engine core, TP/PP workers, data-parallel "
        "coordinator). 'spawn': a fresh interpreter each, which imports vLLM again (about 10 s of CPU each on "
        "vLLM's CPU build). 'forkserver': forked from one server process per caller that imports vLLM once, each "
        "with the caller's environment at its start (spawned instead where the variables an interpreter reads "
        "when it starts, such as PYTHONPATH, changed since the server started, or where OpenMP's binding puts a "
        "worker's threads on different cores). 'auto': forkserver on vLLM's CPU "
        "build, spawn on CUDA (where forkserver has not yet been verified). The fork server stays up while the caller "
        "runs, with vLLM imported (about 0.75 GB on the CPU build).",
    )
    worker_wait: Literal["auto", "spin", "nap"] = Field(
        "auto",
        description="How the engine's worker processes wait for its next step, in the second after each one. "
        "'spin': vLLM's own wait, a busy loop that yields the core only when another process asks for it. 'nap': "
        "a worker sleeps 0.5 ms between checks (about a tenth of a core while it waits; a step may start up to "
        "0.5 ms later). 'auto': nap on vLLM's CPU build, where the workers share their cores with the caller and "
        "whatever else runs there, spin elsewhere. Engines without worker processes (in-process, TP=PP=1) are "
        "not affected.",
    )
    capture: Literal["auto", "local", "shm", "rpc"] = Field(
        "auto",
        description="How rows come back from the engine: 'local' (engine in this process), 'shm' (shared-memory "
        "slots; workers on this host), 'rpc' (vLLM's collective_rpc; reaches workers on other hosts). "
        "'auto' picks the first that reaches the model's processes.",
    )
    ray_address: str | None = Field(
        None,
        description="Address of an existing Ray cluster ('host:port') for the Ray executor, replicas and vLLM's "
        "data parallel; None: Ray's own RAY_ADDRESS, else the cluster this process is connected to, else what "
        "vLLM does by default (a local Ray instance).",
    )
    replicas: PositiveInt = Field(
        1,
        description="Run this many engines as Ray actors, each with the other options (its own TP/PP if asked), "
        "behind one client: a batch is split across them, and a particle's next request goes where its context "
        "was computed so that vLLM's prefix cache keeps working.",
    )
    model_runner: Literal["auto", "v1", "v2"] = Field(
        "auto",
        description="vLLM's model runner, and with it the capture processor genlm plugs in (the two runners' "
        "logits-processor interfaces differ). 'auto': the one vLLM picks (Model Runner V2 on CUDA unless "
        "VLLM_USE_V2_MODEL_RUNNER=0 or the engine uses a feature V2 lacks; V1 on vLLM's CPU build, which has no "
        "Triton). 'v1' / 'v2' set VLLM_USE_V2_MODEL_RUNNER for the engine's processes. Every layout runs on both.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="vLLM's async scheduling (it schedules step N+1 while step N runs). None: off for live "
        "sessions (engine='llm' with live.enabled): a session's next chunk exists only once the program has read "
        "this step's row, so there is no step to overlap, and vLLM's scheduling ahead of outputs has not been "
        "verified with parked sessions and fork copies (vLLM's CPU build always turns it off); vLLM's default "
        "otherwise (on, on CUDA: AsyncLLM and plain generate send one-token requests, which vLLM never schedules "
        "past their last token). True is refused with live sessions.",
    )
    engine_opts: dict[str, Any] = Field(
        default_factory=dict,
        description="More keyword arguments for vllm.LLM (or AsyncLLM), passed on unchanged; those that decide the "
        "layout (tensor/pipeline/data parallel sizes, the executor and data-parallel backends) are also read typed "
        "(genlm_vllm.layout.ParallelSettings), so a wrong type is an error naming the argument.",
    )

    @model_validator(mode="after")
    def _possible_layout(self) -> VLLMOptions:
        lay = layout(self)  # raises ValueError for a combination no engine can run
        if self.sessions_in(lay) and (self.async_scheduling or self.engine_opts.get("async_scheduling")):
            raise ValueError(
                "async_scheduling=True cannot run live sessions (they wait for each step's row before the next "
                "chunk exists): set live={'enabled': False}, or engine='async'"
            )
        return self

    def sessions_in(self, lay: Any) -> bool:
        """Whether an engine laid out as ``lay`` keeps particles alive as vLLM sessions."""
        return self.live.enabled and not lay.streaming
