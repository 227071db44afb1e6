"""Starting an engine: its arguments (:mod:`.engine_args`), its environment (:mod:`.env`), how its
processes start (:mod:`.processes`) and the shared-memory files they leave (:mod:`.files`). The steps
run in this order by :func:`genlm_vllm.drivers.launch.launch`."""
