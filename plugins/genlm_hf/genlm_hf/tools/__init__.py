"""Developer tools, apart from the runtime (no runtime module imports them): the contract check of
transformers releases' sources against :data:`genlm_hf.transformers_api.INTERFACES`
(``python -m genlm_hf.tools.contract``)."""
