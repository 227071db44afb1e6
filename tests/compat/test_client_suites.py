"""The ecosystem's own tests, unmodified, on genlm (genlm-control's, llamppl's, genlm-backend's and
genlm-bytes'): every test that passes on the seeds here (``seed_passing.txt``, measured by
``python -m tests.compat.client_suites``) must pass, but for the few that read the seeds' private state
(``PRIVATE_STATE``, each listed with its reason in the migration page)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .client_suites import CLIENTS, PRIVATE_STATE, SEED_PASSING


@pytest.mark.slow
@pytest.mark.clients
@pytest.mark.parametrize("name", list(CLIENTS))
def test_client_suite_passes_on_genlm(name, on_genlm):  # on_genlm: conftest.py
    listed = SEED_PASSING.read_text().splitlines()
    expected = [t for t in listed if t.startswith(f"{name}::") and t not in PRIVATE_STATE]
    assert expected, f"no reference results for {name} in {SEED_PASSING.name}"
    outcomes = on_genlm[name]
    lost = [t for t in expected if outcomes.get(t) != "passed"]
    assert not lost, f"{len(lost)} of {len(expected)} tests that pass on genlm-backend fail on genlm: {lost}"


def test_every_private_state_exception_is_in_the_migration_page():
    page = (Path(__file__).parents[2] / "docs" / "migration.md").read_text()
    for test, reason in PRIVATE_STATE.items():
        assert test.rsplit("::", 1)[1] in page and reason in page, test
