"""Developer tools, apart from the runtime (no runtime module imports them): the contract check of vLLM
releases' sources (``python -m genlm_vllm.tools.contract``) and the self-test against genlm-hf
(``python -m genlm_vllm.tools.selftest``, ``pip install 'genlm-vllm[selftest]'``)."""
