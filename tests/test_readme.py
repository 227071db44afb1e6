"""The README's code examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def promised_prints(code: str) -> list[str]:
    """What ``print(...)  # prints X: ...`` comments in ``code`` say it prints, in order."""
    return re.findall(r"^print\(.*\)  # prints (.+?): ", code, flags=re.M)


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.toml").write_text(blocks("toml")[0])
    namespace: dict = {}
    runnable = blocks("python")  # ```py blocks are illustrative and not run
    assert len(runnable) >= 2
    for code in runnable:
        exec(compile(code, str(README), "exec"), namespace)
    assert namespace["lm"].options.seed == 1  # the config file was loaded
    assert len(namespace["best"]) == 64
    printed = capsys.readouterr().out.splitlines()
    promised = promised_prints(runnable[0])
    assert promised and printed[: len(promised)] == promised  # the Quick start's comments say what it prints


def test_readme_has_exactly_two_setup_commands():
    commands = blocks("bash")[:2]
    assert commands[0].strip().endswith("examples/smc.py")
    assert commands[1].strip().endswith("-m pytest")
