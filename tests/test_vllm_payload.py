"""The GPU check's vLLM payload (``scripts/vllm_payload.py``), on small synthetic wheels: wheels laid out
as an installer would, each trimming rule removing what it names and refusing a layout it does not
match, annotations postponed so that a module naming a missing library imports, and the parts packed,
checked and unpacked back to the same files (a damaged or foreign part refused)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("genlm_vllm_payload", ROOT / "scripts" / "vllm_payload.py")
assert spec is not None and spec.loader is not None
payload = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = payload  # dataclasses look their module up while the class is made
spec.loader.exec_module(payload)

GUIDANCE = '''"""A structured-output backend."""
import dataclasses

from lazy import llguidance  # a lazy module: naming an attribute imports the library


@dataclasses.dataclass
class Grammar:
    matcher: llguidance.LLMatcher
'''
LAZY = """class _Lazy:
    def __getattr__(self, name):
        raise ModuleNotFoundError("No module named 'llguidance'")


llguidance = _Lazy()
"""


def make_wheel(path: Path, files: dict[str, bytes | str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A site folder from two synthetic wheels shaped like vLLM's and a small dependency's."""
    vllm = make_wheel(
        tmp_path / "vllm-0.0.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        {
            "vllm/__init__.py": "",
            "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 1000,
            "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"\1" * 10,
            "vllm/_moe_C_stable_libtorch.abi3.so": b"\2" * 300,
            "vllm/third_party/deep_gemm/include/cute/a.hpp": "x" * 50,
            **{f"vllm/third_party/deep_gemm/_C.cpython-{v}-x86_64-linux-gnu.so": b"\3" for v in (310, 311, 313, 314)},
            "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"\4",
            "vllm/v1/structured_output/backend_guidance.py": GUIDANCE,
            "vllm-0.0.0.dist-info/WHEEL": "Tag: cp38-abi3-manylinux_2_28_x86_64\n",
        },
    )
    small = make_wheel(
        tmp_path / "small-1.0-py3-none-any.whl",
        {
            "small/__init__.py": "VALUE = 1\n",
            "small-1.0.data/purelib/small_extra.py": "EXTRA = 2\n",
            "small-1.0.data/scripts/small-cli": "#!/bin/sh\n",
            "small-1.0.data/headers/small.h": "",
            "small-1.0.dist-info/WHEEL": "Tag: py3-none-any\n",
        },
    )
    out = tmp_path / "stage" / "site"
    written = payload.extract_wheel(vllm, out) + payload.extract_wheel(small, out)
    assert "small_extra.py" in written and "bin/small-cli" in written and "small/__init__.py" in written
    assert not any("headers" in w or ".data" in w for w in written)
    (out / "lazy.py").write_text(LAZY)
    return out


def test_a_wheel_cannot_write_outside_the_site(tmp_path):
    evil = make_wheel(tmp_path / "evil-1.0-py3-none-any.whl", {"../outside.py": ""})
    with pytest.raises(ValueError, match="outside"):
        payload.extract_wheel(evil, tmp_path / "site")
    assert not (tmp_path / "outside.py").exists()


def test_each_rule_removes_what_it_names_and_nothing_else(site):
    rules = [
        payload.Drop(("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",), "FA2"),
        payload.Drop(("vllm/_moe_C*.so",), "MoE"),
        payload.Drop(
            (
                "vllm/third_party/deep_gemm/include/*",
                *(f"vllm/third_party/deep_gemm/_C.cpython-{v}-x86_64-linux-gnu.so" for v in (310, 311, 313, 314)),
            ),
            "DeepGEMM",
        ),
    ]
    before = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}
    report = payload.drop_files(site, rules)
    after = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}
    assert before - after == {
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/third_party/deep_gemm/include/cute/a.hpp",
        *(f"vllm/third_party/deep_gemm/_C.cpython-{v}-x86_64-linux-gnu.so" for v in (310, 311, 313, 314)),
    }
    assert "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so" in after  # the machine's Python
    assert [(r["files"], r["bytes"]) for r in report] == [(1, 1000), (1, 300), (5, 54)]
    assert not (site / "vllm/third_party/deep_gemm/include").exists()  # emptied folders go too


def test_a_pattern_that_matches_nothing_stops_the_build(site):
    with pytest.raises(ValueError, match=r"no file .* matches 'vllm/renamed_fa2\.so' .*the layout changed"):
        payload.drop_files(site, [payload.Drop(("vllm/renamed_fa2.so",), "FA2")])
    with pytest.raises(ValueError, match=r"matches 'vllm/_moe_D\.so'"):  # one of a rule's patterns is enough
        payload.drop_files(site, [payload.Drop(("vllm/_moe_C*.so", "vllm/_moe_D.so"), "MoE")])
    assert (site / "vllm/_moe_C_stable_libtorch.abi3.so").exists()  # checked before anything is removed


def test_the_real_rules_and_patches_name_what_is_in_the_release():
    """The rules for vLLM 0.26.0's wheel: each pattern is specific (a glob for one kind of file) and
    every patched module is a structured-output backend."""
    assert all(rule.patterns and rule.why for rule in payload.DROP)
    assert all(p.startswith("vllm/v1/structured_output/") for p in payload.FUTURE_ANNOTATIONS)
    assert payload.VLLM == "vllm==0.26.0"
    assert len({w.split("==")[0] for w in payload.WHEELS}) == len(payload.WHEELS)


def run_python(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=site)


def test_postponed_annotations_let_a_module_import_without_its_library(site):
    module = site / "vllm/v1/structured_output/backend_guidance.py"
    code = "import vllm.v1.structured_output.backend_guidance as m; print(m.__doc__)"
    before = run_python(site, code)
    assert before.returncode != 0 and "No module named 'llguidance'" in before.stderr
    payload.postpone_annotations(module, "llguidance")
    after = run_python(site, code)
    assert after.returncode == 0, after.stderr
    assert after.stdout.strip() == "A structured-output backend."  # the docstring is still the docstring
    with pytest.raises(ValueError, match="already postpones"):
        payload.postpone_annotations(module, "llguidance")
    with pytest.raises(ValueError, match="does not name xgrammar"):
        payload.postpone_annotations(module, "xgrammar")


def test_parts_are_checked_stashed_one_run_at_a_time_and_unpacked_to_the_same_files(site, tmp_path):
    import os

    (site / "noise.bin").write_bytes(os.urandom(40_000))  # incompressible: several parts
    parts = payload.pack(site.parent, tmp_path / "parts", part_bytes=16_384)
    assert len(parts) >= 3 and all(p.stat().st_size <= 16_384 for p in parts)
    sums = payload.read_sums(tmp_path / "parts" / "SHA256SUMS")
    assert sorted(sums) == [p.name for p in parts]
    home = tmp_path / "home"
    for i, part in enumerate(parts):  # each run carries one part (and SHA256SUMS)
        carried = tmp_path / f"run{i}"
        carried.mkdir()
        (carried / part.name).write_bytes(part.read_bytes())
        (carried / "SHA256SUMS").write_bytes((tmp_path / "parts" / "SHA256SUMS").read_bytes())
        said = payload.stash([carried], home)
        if i < len(parts) - 1:
            assert said.startswith(f"stashed {i + 1} of {len(parts)} parts") and not (home / "site").exists()
    assert said.startswith("every part is there; unpacked into")
    original = {p.relative_to(site): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    unpacked = {p.relative_to(home / "site"): p.read_bytes() for p in (home / "site").rglob("*") if p.is_file()}
    assert unpacked == original
    assert payload.stash([], home) == f"every part is there; already unpacked in {home / 'site'}"


def test_a_damaged_or_foreign_part_is_refused(site, tmp_path):
    parts = payload.pack(site.parent, tmp_path / "parts", part_bytes=1 << 20)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "SHA256SUMS").write_bytes((tmp_path / "parts" / "SHA256SUMS").read_bytes())
    data = bytearray(parts[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / parts[0].name).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256 is not the one in SHA256SUMS"):
        payload.stash([damaged], tmp_path / "home")
    (damaged / parts[0].name).unlink()
    (damaged / f"{payload.PART_PREFIX}99").write_bytes(b"x")
    with pytest.raises(ValueError, match="not listed in SHA256SUMS"):
        payload.stash([damaged], tmp_path / "home")


def test_packages_built_for_another_python_are_named(site):
    dist = site / "fast-1.0.dist-info"
    dist.mkdir()
    (dist / "WHEEL").write_text("Tag: cp312-cp312-manylinux_2_28_x86_64\n")
    (dist / "RECORD").write_text("fast/__init__.py,,\nfast/_core.cpython-312-x86_64-linux-gnu.so,,\nfast.pth,,\n")
    assert payload.foreign_builds(site, python=(3, 11)) == ["fast", "fast.pth"]
    assert payload.foreign_builds(site, python=(3, 12)) == []  # the machine's Python: nothing foreign
