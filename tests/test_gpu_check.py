"""``scripts/gpu_check.sh --dry-run --offline``, the GPU check's CPU stand-in, as a user runs
it: a fresh shell process. Every step must run and pass, every version be reported, and
``$OUT`` stay within what the device tool brings back (8 files, 2 folders down, plain
names). The carried wheels are optional: without ``.whl/`` the install says so; with it
(``scripts/gpu_wheels.sh``) the install is resolved for the machine's CPython 3.12.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("python", "torch", "GPU", "nvcc", "triton", "fbgemm_gpu", "tensordict", "torchrec",
            "kt_regroup")


def _run(out: Path, *args: str, **env: str) -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--offline", "--out",
         str(out), *args],
        env={**os.environ, "PYTHON": sys.executable, **env}, cwd=ROOT,
        capture_output=True, text=True, timeout=600,
    )
    report = (out / "gpu_check.md").read_text()
    assert proc.returncode == 0, f"{report}\n{proc.stderr[-3000:]}"
    return report


def _assert_steps_ok(report: str, steps) -> None:
    for name in steps:
        assert re.search(rf"^- {name}: ok in \d+ s$", report, re.M), f"{name} not ok:\n{report}"
    assert "FAILED" not in report and "all steps passed" in report


def _assert_out_comes_back(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", s) for s in rel.parts)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    return out, _run(out)


def test_dry_run_passes_every_step_and_reports_every_version(dry_run):
    out, report = dry_run
    _assert_steps_ok(report, ("environment", "tests", "training_step", "bench_seed_float32",
                              "bench_scattered_bfloat16"))
    if list((ROOT / ".whl").glob("*.whl")):
        _assert_steps_ok(report, ("install",))
        assert re.search(r"^- install: \d+ wheels: .*torchrec-.*fbgemm", report, re.M) or \
            re.search(r"^- install: \d+ wheels: .*fbgemm.*torchrec-", report, re.M)
    else:
        assert "- install: no wheels, skipped install" in report
    assert "DRY RUN" in report and "nothing was measured on a GPU" in report
    for name in VERSIONS:
        assert re.search(rf"^    {name} \S", report, re.M), f"no {name} version:\n{report}"
    assert re.search(r"^    torchrec \d", report, re.M), "torchrec imports here"
    assert "KTRegroupAsDict on torchrec KeyedTensors" in report
    _assert_out_comes_back(out)


def test_dry_run_keeps_the_bench_json_and_reads_the_goals_from_it(dry_run):
    out, report = dry_run
    records = json.loads((out / "bench.json").read_text())["records"]
    kt = [r for r in records if r["provider"].startswith("kt_regroup") and r["n"] > 0]
    assert kt and all(r["check"] == "ok" for r in kt), {r["provider"]: r["check"] for r in kt}
    assert {(r["layout"], r["dtype"]) for r in kt} == {("seed", "float32"),
                                                        ("scattered", "bfloat16")}
    assert "## Benchmark, seed layout, float32" in report
    assert "## Benchmark, scattered layout, bfloat16" in report
    goals = report.split("## Goals (issue 17")[1]
    rows = re.findall(r"^\| (seed \| float32|scattered \| bfloat16) \| (forward|forward\+backward, ones|"
                      r"forward\+backward, expanded) \| (True|False) \| \d+\.\d\d \| \d+\.\d\d "
                      r"\| (yes|\*\*NO\*\*) \| \S+ \|$", goals, re.M)
    assert len(rows) == 12, goals
    assert len(re.findall(r"duplicates / no duplicates \(op, P50\) \d+\.\d\d", goals)) == 6, goals


def test_without_torchrec_the_training_step_and_bench_run_at_op_level(tmp_path):
    report = _run(tmp_path, "--only", "training_step,bench", KT_GPU_CHECK_NO_TORCHREC="1")
    _assert_steps_ok(report, ("environment", "training_step", "bench_op_level"))
    assert "- tests: not asked" in report
    assert "torchrec does not import: SKIPPED" in report
    assert "op level (torchrec missing)" in report
    rows = json.loads((tmp_path / "bench_op_level.json").read_text())["rows"]
    assert {(r["dtype"], r["duplicates"]) for r in rows} == {
        (d, dup) for d in ("torch.float32", "torch.bfloat16") for dup in (False, True)}
    assert all(r["kt_p50_s"] > 0 and r["copy_p50_s"] > 0 for r in rows)
    _assert_out_comes_back(tmp_path)
