"""The GPU check (``scripts/gpu_check.sh``, ``benchmarks/gpu_check.py``): its dry run passes on the CPU with
every part and section, through the same script, driver and part processes as on the GPU machine; a broken
tolerance fails it; and its model shapes are the real models'."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("genlm_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
assert spec is not None and spec.loader is not None
gpu_check = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu_check
spec.loader.exec_module(gpu_check)


def dry_run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.slow
@pytest.mark.process
def test_the_dry_run_passes_with_every_part_and_section(tmp_path):
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = {p["part"]: p for p in summary["parts"]}
    assert list(parts) == list(gpu_check.DRY_PARTS)
    assert all(p["ok"] and not p["failures"] for p in parts.values())
    sections = {t["section"] for p in parts.values() for t in p.get("tables", [])}
    assert sections == {"rows", "trie", "smc", "flush", "step", "profile"}
    rows = parts["rows"]["numbers"]
    for dtype in ("float32", "bfloat16"):  # within twice HF's own unbatched error against float64
        assert rows[dtype]["max_abs_diff"] <= rows[dtype]["tolerance"] == 2 * rows[dtype]["plain_diff"], rows[dtype]
    assert rows["float32"]["row_devices"] == ["cpu"]
    # float64 sums of V probabilities in two orders (twice bounds.sum_error in float64); maxima exact
    assert all(v["max_abs_diff"] <= v["tolerance"] for v in parts["trie"]["numbers"].values())
    assert all(v["tolerance"] == 0.0 for k, v in parts["trie"]["numbers"].items() if k.startswith("max"))
    assert {"flush idle", "flush eager"} <= set(parts["smc:tiny"]["numbers"])
    assert parts["overhead"]["json"]["cells"]  # bench_overhead.py ran and wrote its --json
    for key, section in gpu_check.SECTIONS.items():
        assert f"== {section}" in done.stdout or section.startswith("3.") or key.startswith("vllm")
        assert f"## {section}" in (tmp_path / "gpu_check.md").read_text()
    assert "all parts passed" in done.stdout


def step_args(tmp_path: Path, **more: str) -> argparse.Namespace:
    """A dry run's arguments for one step or profile part run in this process, at the smallest size."""
    args = {"dry_run": True, "device": "cpu", "step_rounds": None, "result": str(tmp_path / "logs" / "part.json")}
    return argparse.Namespace(**{**args, **more})


def test_the_step_part_times_genlms_model_call_and_smc_step_beside_the_bare_step(tmp_path):
    """Each cell: as many bare steps, model calls and SMC steps as rounds; every particle a row of its own
    with one new token per SMC step (KV reuse), given to the model as a plain step; the model call inside
    the backend's step; the ratios are the medians of each round's."""
    part = gpu_check.Part("step:tiny")
    gpu_check.part_step(part, step_args(tmp_path, step_n="8", step_prompts="24", step_rounds="3"), "tiny")
    assert part.failures == []
    # genlm-hf's defaults, the opt-in room, and (at N = 8) particles resampled every step
    assert list(part.numbers) == [
        "N8 p24",
        "N8 p24 decode_room=32",
        "N8 p24 resampled",
    ]
    resampled = part.numbers.pop("N8 p24 resampled")
    assert 1 < resampled["rows"] < 8 and min(resampled["times"]["gather"]) > 0  # duplicates; every past gathered
    for key, cell in part.numbers.items():
        times = cell["times"]
        assert {len(v) for v in times.values()} == {3} and all(t > 0 for t in times["bare"] + times["model call"])
        assert cell["rows"] == cell["computed"] == int(key.split()[0][1:])
        assert cell["plain"] == 1  # every counted model call as HF's own decode step: no mask, no positions
        for r in range(3):  # the same step's (the untimed SMC step is the next one)
            assert 0 < times["model call"][r] <= times["forward_batch"][r]
        ratios = sorted(b / a for a, b in zip(times["bare"], times["model call"]))
        assert cell["model_call_ratio"] == pytest.approx(ratios[1])
    (table,) = part.tables
    assert table["section"] == "step" and [r[1] for r in table["rows"]] == ["8", "8", "8"]


def test_the_profile_part_sets_the_bare_step_beside_genlms_model_call(tmp_path):
    """The same model's layers run in both (as many matrix products and attention calls per step); the
    profiled model call is one SMC step's (4 rows of one new token after the 24-token prompt and one
    sampled token); the full tables are written."""
    part = gpu_check.Part("profile:tiny")
    gpu_check.part_profile(part, step_args(tmp_path, step_n="4", step_prompts="24"), "tiny")
    assert part.failures == []
    (cell,) = part.numbers.values()
    assert cell["step"] == {"rows": 4, "width": 1, "past": 25}
    assert sorted(Path(f).name for f in cell["files"]) == [
        "profile-N4-SMC-step.txt",
        "profile-N4-bare-step.txt",
        "profile-N4-model-call.txt",
    ]
    calls = cell["calls"]  # every op, not only the top of the table (a light op may rank below it)
    for op in ("aten::linear", "aten::scaled_dot_product_attention"):
        assert calls["bare step"][op] == calls["model call"][op] > 0, op
    assert [t["title"].rsplit(": ", 1)[1] for t in part.tables] == [
        "top ops by self time",
        "ops run a different number of times",
        "totals",
    ]


HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.slow
@pytest.mark.process
def test_a_broken_tolerance_fails_the_check_and_the_vllm_parts_run_on_the_cpu_build(tmp_path):
    """A float32 rows tolerance no row meets fails the rows part, the run and its exit status. With vLLM's CPU
    build installed, the same run has the vllm parts (one script and driver for all: each part runs in its
    own process and is judged by itself): a vllm:rows tolerance no row meets fails vllm:rows, whose numbers
    still meet the real tolerances (genlm-vllm's rows against genlm-hf and vLLM's logprobs, the shared live
    check), and vllm:smc, bench_smc.py's vLLM rows on a dummy-weight model, passes."""
    only, tolerances, failed = "rows", ["--rows-tol", "1e-12"], ["rows"]
    if HAS_VLLM:
        only, tolerances, failed = "rows,vllm", [*tolerances, "--vllm-tol", "1e-12"], ["rows", "vllm:rows"]
    done = dry_run(tmp_path, "--only", only, *tolerances)
    assert done.returncode == 1, done.stdout[-6000:] + done.stderr[-3000:]
    assert "FAIL [rows] float32 rows on cpu differ from the CPU float64 reference" in done.stdout
    parts = {p["part"]: p for p in json.loads((tmp_path / "gpu_check.json").read_text())["parts"]}
    assert [name for name, p in parts.items() if not p["ok"]] == failed
    assert f"FAILED: {', '.join(failed)};" in done.stdout
    if not HAS_VLLM:
        assert list(parts) == ["rows"]
        return
    assert list(parts) == ["rows", *gpu_check.VLLM_DRY_PARTS]
    assert "FAIL [vllm:rows] rows differ from genlm-hf's by" in done.stdout
    assert [f.split(" by ")[0] for f in parts["vllm:rows"]["failures"]] == ["rows differ from genlm-hf's"]
    rows = parts["vllm:rows"]["numbers"]
    assert rows["rows"]["vs_hf_kept"] <= rows["rows"]["tolerance_vs_hf_kept"]  # the real tolerances
    assert rows["rows"]["vs_vllm_logprobs"] <= rows["rows"]["tolerance_vs_vllm_logprobs"]
    assert rows["live"]["forked"] > 0 and rows["live"]["tokens_copied"] > 0
    smc = parts["vllm:smc:vtiny"]["numbers"]
    assert {f"N{n} p{p} {m}" for n in (4, 8) for p in (24, 100) for m in ("lipogram", "none")} <= set(smc)
    assert all(v["rows"] > 0 and 0 < v["busy"] <= 1 for k, v in smc.items() if k.startswith("N"))
    assert {t["section"] for n, p in parts.items() if n != "rows" for t in p["tables"]} == {"vllm", "vllm-smc"}


@pytest.mark.parametrize(("shape", "params"), [("135m", 134.5e6), ("1b", 1.236e9), ("8b", 8.030e9)])
def test_the_shapes_are_the_real_models(shape, params):
    import torch

    from genlm_core.testing.tokenizers import toy_tokenizer

    model = gpu_check.build_llama(shape, toy_tokenizer(), "meta", torch.bfloat16)  # no memory, no weights
    assert abs(sum(p.numel() for p in model.parameters()) - params) / params < 0.002


def test_the_vllm_parts_say_what_to_carry_when_vllm_is_not_there(tmp_path, monkeypatch):
    """On the GPU machine the vllm parts need the carried vLLM (scripts/vllm_payload.py): without it
    they say how to get it; with it, its folder goes on the parts' path after genlm-vllm's."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm_payload

    monkeypatch.setattr(vllm_payload, "HOME", tmp_path)
    env: dict[str, str] = {"PYTHONPATH": "/elsewhere"}
    problem = gpu_check.vllm_environment(env, dry=False)
    assert problem is not None and "--prepare vllm" in problem and "--stash" in problem
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    assert gpu_check.vllm_environment(env, dry=False) is None
    plugin = str(ROOT / "plugins" / "genlm_vllm")
    assert env["PYTHONPATH"].split(os.pathsep) == [plugin, str(tmp_path / "site"), "/elsewhere"]
