"""The adapter: every vLLM name genlm-vllm imports, calls, reads, patches or subclasses is reached
through this package and listed in :mod:`~genlm_vllm.vllm_api.manifest`.

- :mod:`~genlm_vllm.vllm_api.release`: loading vLLM, which release it is, what it offers, the model runner;
- :mod:`~genlm_vllm.vllm_api.client`: the caller's side (engines, requests, the engine core, resident requests);
- :mod:`~genlm_vllm.vllm_api.worker`: inside the model's processes (parallel groups, KV copies, block hashes);
- :mod:`~genlm_vllm.vllm_api.fixes`: corrections to the CPU build, applied where a probe finds the bug;
- :mod:`~genlm_vllm.vllm_api.manifest`: the names above, checked against each release's sources.

Importing any of them imports no vLLM and changes nothing.
"""
