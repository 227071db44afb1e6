"""The transformers internals genlm-hf relies on, all in genlm_hf.transformers_api, checked from the sources of
the installed release and of the newest release in our range (genlm_hf.tools.contract); the checker fails on
a release that changed what we use."""

from __future__ import annotations

import ast
import shutil
import tomllib
from pathlib import Path

import pytest

from genlm_core.testing.sources import installed_sources, release_version
from genlm_hf import transformers_api
from genlm_hf.tools import contract

PLUGIN = Path(transformers_api.__file__).parent
ROOT = PLUGIN.parent.parent.parent


def test_only_the_adapter_imports_transformers_or_names_its_internals():
    offenders = []
    internals = ("ddp_cache_data", "_attn_implementation", "DynamicLayer", "get_text_config")
    for path in sorted(PLUGIN.rglob("*.py")):
        if path.name == "transformers_api.py":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                modules = []
            offenders += [f"{path.name}: import {m}" for m in modules if m.split(".")[0] == "transformers"]
            if isinstance(node, ast.Attribute) and node.attr in (*internals, "layers"):
                offenders.append(f"{path.name}: .{node.attr}")
        offenders += [f"{path.name}: {name}" for name in internals if name in text]
    assert offenders == []


def test_the_tested_range_is_genlm_core_s():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{transformers_api.TESTED}" in dependencies


def test_the_installed_transformers_has_every_internal_we_use():
    assert contract.check(installed_sources("transformers")) == []


@pytest.mark.slow
@pytest.mark.releases
def test_the_newest_transformers_in_our_range_has_every_internal_we_use():
    """Downloaded once with pip download --no-deps (about 12 MB; only its .py files are kept)."""
    from packaging.specifiers import SpecifierSet

    root = contract.newest_sources()
    assert release_version(root) in SpecifierSet(transformers_api.TESTED)
    assert contract.check(root) == []


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def test_the_check_fails_on_a_release_that_changed_what_we_use(tmp_path):
    """A copy of the installed transformers with four changes, each named by the check."""
    root = tmp_path / "transformers"
    installed = installed_sources("transformers")
    shutil.copytree(
        installed, root, ignore=lambda folder, names: [n for n in names if not n.endswith(".py") and "." in n]
    )
    cache = root / "cache_utils.py"
    edit(cache, "self.is_initialized = True\n", "self.initialized = True\n")
    edit(cache, "self.is_initialized = False\n", "self.initialized = False\n")
    text = cache.read_text()
    start = text.index("class DynamicLayer(")
    update = text.index("def update(", start)
    cache.write_text(
        text[:update]
        + text[update:].replace("key_states: torch.Tensor, value_states", "keys: torch.Tensor, value_states", 1)
    )
    edit(root / "configuration_utils.py", "def _attn_implementation(self", "def _attention_implementation(self")
    edit(
        root / "models/llama/modeling_llama.py",
        "logits_to_keep: int | torch.Tensor = 0,",
        "keep: int | torch.Tensor = 0,",
    )
    problems = contract.check(root)
    expected = [
        "cache_utils.py: DynamicLayer has no attribute is_initialized",
        "cache_utils.py: DynamicLayer.update takes ['keys', 'value_states'",
        "configuration_utils.py: PreTrainedConfig._attn_implementation is missing",
        "modeling_llama.py: LlamaForCausalLM.forward has no parameter logits_to_keep",
    ]
    for phrase in expected:
        assert any(phrase in p for p in problems), (phrase, problems)
    assert len(problems) == len(expected), problems


@pytest.mark.parametrize("argv", [["--installed"], []])
def test_the_command_line(capsys, argv):
    if not argv:
        with pytest.raises(SystemExit):
            contract.main(argv)
        return
    assert contract.main(argv) == 0
    assert ": ok" in capsys.readouterr().out
