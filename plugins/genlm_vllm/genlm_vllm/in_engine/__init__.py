"""The code vLLM loads by name inside its own processes (scheduler, workers): the capture processors and
the worker extension (:mod:`.capture`) and the fork connector (:mod:`.forks`). The caller's process
never imports it, except where vLLM does to validate requests."""
