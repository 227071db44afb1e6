"""What a process the test session started leaves out of its imports, where nothing it runs uses it.

``rfc3987_syntax`` builds an Earley parser of RFC 3987 when it is imported: 1.1 to 2 CPU-s. ``jsonschema``
imports it where it is installed, for its ``iri`` and ``iri-reference`` formats; Ray imports ``jsonschema``,
and vLLM imports Ray, so every process of a whole run that imports vLLM or Ray paid it (44 processes, 53
CPU-s: the pytest workers, Ray's nodes, workers and actors, vLLM's engines, the GPU check's vLLM parts).
None of them checks those formats. It is in the test environment for genlm-control
(``jsonschema[format-nongpl]``), whose JSON potential checks formats: the client suites' processes keep it
(their ``sitecustomize.py`` does not call this)."""

from __future__ import annotations

import sys

LEFT_OUT = ("rfc3987_syntax",)


def leave_out() -> None:
    """Make ``import`` of each module of :data:`LEFT_OUT` raise ``ImportError``, as where it is not installed."""
    for name in LEFT_OUT:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None in sys.modules: "not importable"
