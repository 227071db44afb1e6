"""genlm-control's and llamppl's own tests, unmodified, on genlm: every test that passes on genlm-backend
here (``seed_passing.txt``, measured by ``python -m tests.compat.client_suites``) must pass."""

from __future__ import annotations

import pytest

from .client_suites import CLIENTS, SEED_PASSING, run


@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_suite_passes_on_genlm(name, tmp_path):
    expected = [t for t in SEED_PASSING.read_text().split() if t.startswith(f"{name}::")]
    assert expected, f"no reference results for {name} in {SEED_PASSING.name}"
    outcomes = run(name, on_genlm=True, junit=tmp_path / "junit.xml")
    lost = [t for t in expected if outcomes.get(t) != "passed"]
    assert not lost, f"{len(lost)} of {len(expected)} tests that pass on genlm-backend fail on genlm: {lost}"
