"""The engine drivers: each runs vLLM one way (``vllm.LLM``, ``AsyncLLM``, replicas as Ray actors) behind
:class:`~genlm_vllm.drivers.base.EngineDriver`; :func:`~genlm_vllm.drivers.select.start_driver` picks one."""
