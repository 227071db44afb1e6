"""The docs' ``python`` code blocks run as written, page by page (``py`` blocks are illustrative)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())


def test_the_docs_have_runnable_examples():
    assert {p.name for p in PAGES} >= {"index.md", "tries.md", "bytes.md", "compat.md", "mock.md"}


def runs_a_real_model(page: Path) -> bool:
    """A page whose examples load SmolLM2-135M runs in the slow tier (``realmodel``), the others in the fast."""
    return "smollm2" in "".join(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)).lower()


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=[pytest.mark.slow, pytest.mark.realmodel]) if runs_a_real_model(p) else p for p in PAGES],
    ids=[str(p.relative_to(DOCS)) for p in PAGES],
)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        exec(compile(code, str(page), "exec"), namespace)
