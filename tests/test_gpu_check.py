"""``scripts/gpu_check.sh --dry-run --offline``, the GPU check's CPU stand-in, as a user runs
it: a fresh shell process. Every step must run and pass, every version be reported, and
``$OUT`` stay within what the device tool brings back (8 files, 2 folders down, plain
names). The carried wheels are optional: without ``.whl/`` the install says so; with it
(``scripts/gpu_wheels.sh``) the install is resolved for the machine's CPython 3.12.

Its failure paths, each of which must be reported without stopping the run: a torch that
lacks an attribute the check reads, a build that fails (then the CPU-only build is tried),
a test step killed at its time limit (its outcome lines kept).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("python", "torch", "torch CUDA", "torch commit", "cuDNN", "GPU", "driver", "nvcc", "fbgemm_gpu",
            "tensordict", "torchrec")


def _run(out: Path, *args: str, ok: bool = True, **env: str) -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--offline", "--out",
         str(out), *args],
        env={**os.environ, "PYTHON": sys.executable, **env}, cwd=ROOT,
        capture_output=True, text=True, timeout=600,
    )
    report = (out / "gpu_check.md").read_text()
    assert (proc.returncode == 0) == ok, f"{report}\n{proc.stderr[-3000:]}"
    # whatever failed, the report is complete: its last line is the result
    assert re.search(r"^Result: .*\(total \d+ s, \d+ files in .*DRY RUN: nothing was "
                     r"measured on a GPU$", report.rstrip().splitlines()[-1]), report
    return report


def _assert_steps_ok(report: str, steps) -> None:
    for name in steps:
        assert re.search(rf"^- {name}: ok in \d+ s$", report, re.M), f"{name} not ok:\n{report}"


def _assert_out_comes_back(out: Path) -> None:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", s) for s in rel.parts)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    # Its smoke on one test of the kernel checks (the suite runs the rest), its tests step
    # on that test (which the passed smoke leaves out) and a CUDA-only one.
    out = tmp_path_factory.mktemp("gpu_check")
    return out, _run(out, KT_GPU_CHECK_SMOKE_K="forward_equals_reference",
                     KT_GPU_CHECK_TESTS="tests/test_cuda_kernel.py::test_forward_equals_reference "
                                        "tests/test_cuda_kernel.py::test_cuda_one_launch_per_call")


def test_dry_run_passes_every_step_and_reports_every_version(dry_run):
    out, report = dry_run
    _assert_steps_ok(report, ("environment", "library", "smoke", "training_step",
                              "bench_seed_float32", "bench_scattered_bfloat16", "tests"))
    assert "FAILED" not in report and "all steps passed" in report
    # the order of issue 36: the kernel checks and the sanitizers first, the seed layout's
    # cells (each one's tables as it ends), the rest, the tests last
    steps = ("environment", "build", "library", "smoke", "memcheck", "racecheck",
             "training_step", "bench_seed_float32", "bench_scattered_bfloat16", "tests")
    order = [report.index(f"- {s}:") for s in steps]
    assert order == sorted(order), report
    assert report.index("## Benchmark, seed layout, float32") < report.index(
        "- bench_scattered_bfloat16:"), report
    assert "- memcheck: skipped (dry run: no GPU)" in report
    assert re.search(r"^    1 passed, \d+ skipped, \d+ deselected in ", report.split("- smoke:")[1],
                     re.M), report
    if list((ROOT / ".whl").glob("*.whl")):
        _assert_steps_ok(report, ("install",))
        assert re.search(r"^- install: \d+ wheels: .*torchrec-.*fbgemm", report, re.M) or \
            re.search(r"^- install: \d+ wheels: .*fbgemm.*torchrec-", report, re.M)
    else:
        assert "- install: no wheels, skipped install" in report
    assert "DRY RUN" in report
    for name in VERSIONS:
        assert re.search(rf"^    {name} \S", report, re.M), f"no {name} version:\n{report}"
    assert re.search(r"^    torchrec \d", report, re.M), "torchrec imports here"
    assert re.search(r"^    kt_regroup \d+\.\d+\.\d+ library \S+", report, re.M), report
    # the library the dry run loads is this process's: CPU-only under CI's torch, with CUDA
    # kernels where torch is a CUDA build and nvcc is there (make test-torch211)
    cuda = torch._C._dispatch_has_kernel_for_dispatch_key("kt_regroup::permute_multi_embedding",
                                                           "CUDA")
    assert f"kt_regroup CUDA kernels: {'yes' if cuda else 'no (CPU-only build)'}" in report
    assert "KTRegroupAsDict on torchrec KeyedTensors" in report
    _assert_out_comes_back(out)


def test_dry_run_selects_the_tests_by_name_with_their_outcomes(dry_run):
    _, report = dry_run
    tests = report.split("- tests: ok")[1]
    k = r"cuda\ and\ not\ \(kernel_check\ and\ \(forward_equals_reference\)\)"  # printf %q
    assert " -v " in tests and f" -k {k} " in tests, tests
    outcomes = re.findall(r"^    (PASSED|SKIPPED|FAILED|ERROR) (tests/.+::.+)$", tests, re.M)
    assert outcomes and all("cuda" in test.lower() for _, test in outcomes), tests
    assert not [t for o, t in outcomes if o in ("FAILED", "ERROR")], tests
    # the smoke ran and passed them: not again
    assert not [t for _, t in outcomes if "forward_equals_reference" in t], tests


def test_dry_run_keeps_the_bench_json_and_reads_the_goals_from_it(dry_run):
    out, report = dry_run
    records = json.loads((out / "bench.json").read_text())["records"]
    kt = [r for r in records if r["provider"].startswith("kt_regroup") and r["n"] > 0]
    assert kt and all(r["check"] == "ok" for r in kt), {r["provider"]: r["check"] for r in kt}
    assert {(r["layout"], r["dtype"]) for r in kt} == {("seed", "float32"),
                                                        ("scattered", "bfloat16")}
    # on CPU there is no device time: the fields are None, the tables say n/a
    for r in records:
        assert r["device_batch"] is None and r["device_p50_s"] is None
        assert r["graph_p50_s"] is None and r["vs_copy_device"] is None
    assert "## Benchmark, seed layout, float32" in report
    assert "## Benchmark, scattered layout, bfloat16" in report
    assert re.search(r"^\| kt_regroup\.permute_multi_embedding \|.*\| n/a \| n/a \| n/a \| n/a \|"
                     r" \d+ \| ok \|$", report, re.M), report
    goals = report.split("## Goals (issue 21")[1]
    rows = re.findall(r"^\| (seed \| float32|scattered \| bfloat16) \| (forward|forward\+backward, "
                      r"ones|forward\+backward, expanded) \| (True|False) \| \d+\.\d\d \| n/a \| "
                      r"n/a \| n/a \| <= (1\.05|1\.11) \| n/a \|$", goals, re.M)
    assert len(rows) == 12, goals
    assert all((g == "1.05") == (mode == "forward") for _, mode, _, g in rows), rows
    vbe = goals.split("## Goals (issue 23")[1]  # the variable-batch op's, from its own rows
    rows = re.findall(r"^\| (seed \| float32|scattered \| bfloat16) \| (vbe forward|vbe forward"
                      r"\+backward) \| \d+\.\d\d \| n/a \| n/a \| n/a \| <= 1\.15 \| n/a \|$",
                      vbe, re.M)
    assert len(rows) == 4 and len(set(rows)) == 4, vbe


def _collected(selection: str) -> set:
    # The script's own kernel_checks and tests_k, then pytest --collect-only.
    functions = "".join(f"source <(sed -n '/^{f}() {{/,/^}}/p' scripts/gpu_check.sh); "
                        for f in ("kernel_checks", "tests_k"))
    proc = subprocess.run(["bash", "-c", functions + selection + " --collect-only"],
                          env={**os.environ, "PY": sys.executable},
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_smoke_selects_the_kernel_checks_of_both_kinds_and_the_tests_step_the_rest():
    # The smoke's default selection (the dry run narrows it) ...
    smoke = _collected("kernel_checks ''; \"${CHECKS[@]}\"")
    kinds = {re.search(r"\[(emulated|cuda)", i)[1] for i in smoke}
    assert len(smoke) > 100 and kinds == {"emulated", "cuda"}, sorted(smoke)[:20]
    assert not [i for i in smoke if "::test_cuda_" in i], smoke
    # ... and, once it passed, the tests step's: every other *cuda* test of the file.
    every = _collected('"$PY" -m pytest -q tests/test_cuda_kernel.py -k cuda')
    rest = _collected('tests_k passed ""; "$PY" -m pytest -q tests/test_cuda_kernel.py -k "$K"')
    assert smoke.isdisjoint(rest) and smoke | rest == every, sorted(every - smoke - rest)[:20]
    assert [i for i in rest if "::test_cuda_" in i], rest


def test_without_torchrec_the_training_step_and_bench_run_at_op_level(tmp_path):
    report = _run(tmp_path, "--only", "training_step,bench", KT_GPU_CHECK_NO_TORCHREC="1")
    _assert_steps_ok(report, ("environment", "library", "training_step", "bench_op_level"))
    assert "- tests: not asked" in report and "all steps passed" in report
    assert "torchrec does not import: SKIPPED" in report
    assert "op level (torchrec missing)" in report
    records = json.loads((tmp_path / "bench.json").read_text())["records"]
    assert {(r["layout"], r["dtype"], r["duplicates"]) for r in records} == {
        (la, d, dup) for la in ("seed", "scattered") for d in ("float32", "bfloat16")
        for dup in (False, True)}
    assert all(r["p50_s"] > 0 and r["device_p50_s"] is None for r in records)
    assert {r["mode"] for r in records} == {"forward", "forward+backward"}
    for mode in ("forward", "forward\\+backward"):
        assert len(re.findall(rf"^\| (seed|scattered) \| (float32|bfloat16) \| {mode} \| "
                              r"(True|False) \| \d+\.\d\d \| n/a \|", report, re.M)) == 8, report
    _assert_out_comes_back(tmp_path)


def test_a_missing_torch_attribute_and_a_failed_build_are_reported_and_the_run_goes_on(
        tmp_path):
    # A torch without attributes the check reads (as torch 2.11 lacks
    # torch._C._cuda_getDriverVersion), and a build that fails (a compiler that does not run).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        "del torch.version.git_version\n"
        "if hasattr(torch._C, '_cuda_getDriverVersion'):\n"
        "    del torch._C._cuda_getDriverVersion\n")
    out = tmp_path / "out"
    report = _run(out, "--build", "--only", "build,training_step", ok=False, CXX="false",
                  PYTHONPATH=os.pathsep.join(filter(None, [str(site),
                                                           os.environ.get("PYTHONPATH")])))
    assert re.search(r"^    torch commit unknown \(AttributeError: .*git_version", report, re.M), report
    for name in VERSIONS:  # every other version still read
        assert re.search(rf"^    {name} \S", report, re.M), f"no {name} version:\n{report}"
    assert re.search(r"^- build: FAILED \(rc \d+\) in \d+ s$", report, re.M), report
    assert "falling back to a CPU-only build (KT_REGROUP_CUDA=0)" in report
    # the fallback ran with KT_REGROUP_CUDA=0 (setup.py says so) and failed the same way
    build, fallback = report.split("- build: FAILED")[1].split("- build_cpu_only: FAILED")
    assert "'false', '--version'" in build and "'false', '--version'" in fallback, report
    assert re.search(r"^  setup\.py: kt_regroup: not building the CUDA kernels: "
                     r"KT_REGROUP_CUDA=0$", fallback, re.M), report
    assert "the CPU-only build FAILED too: the library as it was" in report
    _assert_steps_ok(report, ("environment", "library", "training_step"))
    assert "Result: SOME STEPS FAILED: build build_cpu_only (" in report


def test_a_test_step_killed_at_its_limit_keeps_each_outcome_line(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fake_gpu.py").write_text(
        "import time\n\n"
        "def test_cuda_first():\n    assert 1 + 1 == 2\n\n"
        "def test_cuda_hangs():\n    time.sleep(600)\n\n"
        "def test_not_selected():\n    raise AssertionError('-k cuda leaves this out')\n")
    out = tmp_path / "out"
    report = _run(out, "--only", "tests", ok=False, KT_GPU_CHECK_TESTS=str(tests),
                  KT_GPU_CHECK_TESTS_S="20")
    assert re.search(r"^- tests: FAILED \(rc (124|137), killed at its 20 s limit\) in \d+ s$",
                     report, re.M), report
    assert re.search(r"^    PASSED \S*test_fake_gpu\.py::test_cuda_first$", report, re.M), report
    assert re.search(r"^  killed during: \S*test_fake_gpu\.py::test_cuda_hangs", report, re.M)
    assert "test_not_selected" not in report.split("  command:")[1]
    assert "Result: SOME STEPS FAILED: tests (" in report
