"""The byte-level LM on a real pretrained model (SmolLM2-135M), end to end through the CLI."""

from __future__ import annotations

import pytest

from genlm_core.cli import main


@pytest.mark.slow
@pytest.mark.realmodel
def test_greedy_byte_continuation_is_readable(capsys):
    assert main(["continue", "smollm2", "The capital of France is", "-b", "hf", "-n", "12", "-K", "5"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("The capital of France is Paris")
    assert out.isprintable()
