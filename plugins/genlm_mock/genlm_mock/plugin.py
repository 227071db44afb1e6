"""Registers the ``mock`` backend."""

from genlm_core import Register, hookimpl
from genlm_mock.options import MockOptions


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "mock",
        "genlm_mock.lm:MockAsyncLM.from_options",
        options=MockOptions,
        description="Deterministic random distributions over a real tokenizer's vocabulary (no model).",
    )
