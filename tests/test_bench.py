"""Plumbing of ``python -m kt_regroup.bench``: layouts, records, files. No timing asserts."""

import csv
import json
import os

import pytest
import torch

pytest.importorskip("torchrec")

from kt_regroup.bench import main  # noqa: E402
from kt_regroup.bench.harness import RssPeakProbe, percentile  # noqa: E402
from kt_regroup.bench.layout import PRESETS, layout_from_flags, layout_from_json  # noqa: E402
from kt_regroup.bench.report import CSV_FIELDS, SCHEMA  # noqa: E402

FAST = ["--no_progress", "--repeats", "2", "--min_repeats", "1", "--budget_s", "0",
        "--serving_repeats", "2", "--serving_sample_s", "0.001"]
RECORD_FIELDS = {
    "suite", "allocator", "mode", "grad_mode", "duplicates", "provider", "family", "batch_size",
    "n_features", "dtype", "device", "device_name", "threads", "samples_s", "n", "p50_s", "p90_s",
    "p50_ms", "p90_ms", "mem_p90_mb", "gbps", "bytes_moved", "vs_clone", "vs_copy",
    "vs_kt_regroup", "check", "error",
}


def _load(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    rc = main(["--quick", "--allocator", "default", "--output", str(out), *FAST])
    return rc, str(out)


def test_quick_preset_exits_zero_and_writes_every_file(quick_run):
    rc, out = quick_run
    assert rc == 0
    for name in ("results.json", "results.csv", "runtime.png", "table.md"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "runtime.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_json_schema_and_every_provider_answers_right(quick_run):
    _, out = quick_run
    data = _load(out)
    assert data["schema"] == SCHEMA
    for key in ("torch", "fbgemm_gpu", "torchrec", "kt_regroup"):
        assert data["versions"][key]
    assert data["device"]["type"] == "cpu" and data["device"]["name"]
    assert data["threads"] == torch.get_num_threads()
    assert data["memory_method"]
    records = data["records"]
    cells = {(r["suite"], r["mode"], r["grad_mode"], r["duplicates"]) for r in records}
    assert ("main", "forward", None, False) in cells
    assert ("main", "forward+backward", None, True) in cells
    assert ("serving", "forward", "inference_mode", False) in cells
    assert ("serving", "forward", "autograd", True) in cells
    families = {r["family"] for r in records}
    assert {"kt_regroup", "torchrec", "limit"} <= families
    for r in records:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
        assert r["error"] is None, (r["provider"], r["error"])
        assert r["check"] == "ok", (r["provider"], r["check"])
        assert r["n"] == len(r["samples_s"]) >= 1
        assert r["p50_s"] <= r["p90_s"]
        assert r["vs_clone"] is not None and r["vs_kt_regroup"] is not None
        if r["provider"].startswith("kt_regroup.KTRegroupAsDict"):
            assert r["vs_kt_regroup"] == pytest.approx(1.0)
    main_rows = [r for r in records if r["suite"] == "main"]
    assert all(r["mem_p90_mb"] is not None for r in main_rows) == RssPeakProbe.available()
    assert [g["ratio"] for g in data["goals"]], "the issue-4 ratios are listed"


def test_csv_has_one_row_per_record_with_versions(quick_run):
    _, out = quick_run
    records = _load(out)["records"]
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == CSV_FIELDS
    assert len(rows) == len(records)
    assert {row["torch"] for row in rows} == {torch.__version__}
    assert {row["provider"] for row in rows} == {r["provider"] for r in records}


def test_table_is_in_the_seed_style(quick_run, capsys):
    _, out = quick_run
    with open(os.path.join(out, "table.md")) as f:
        table = f.read()
    assert "| provider | B | F | device | Runtime (P50) | Runtime (P90) |" in table
    assert "limit: clone_dup" in table and "limit: copy_" in table
    assert "/ kt_regroup" in table and "Ratios named by issue 4" in table


def test_layout_file(tmp_path):
    spec = {
        "keys": [["u1", "u2"], ["i1", "i2", "i3"]],
        "lengths": [[3, 1], [7, 1, 127]],
        "groups": [["i3", "u1"], ["u2", "i1", "u1"]],
        "batch_size": 5,
    }
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(spec))
    layout = layout_from_json(str(path))
    assert layout.has_duplicates and layout.n_features == 5 and layout.batch_size == 5
    assert layout.out_lengths == [130, 11]
    out = tmp_path / "out"
    rc = main(["--layout", str(path), "--allocator", "default", "--no_serving",
               "--providers", "kt_regroup,_regroup_keyed,limit", "--output", str(out), *FAST])
    assert rc == 0
    records = _load(str(out))["records"]
    assert {r["batch_size"] for r in records} == {5}
    assert {r["n_features"] for r in records} == {5}
    assert {r["duplicates"] for r in records} == {True}
    assert {r["family"] for r in records} == {"kt_regroup", "torchrec", "limit"}
    assert all(r["check"] == "ok" for r in records)


def test_layout_file_errors_name_the_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"keys": [["a"]], "lengths": [[2]]}))
    with pytest.raises(ValueError, match="groups"):
        layout_from_json(str(path))
    path.write_text(json.dumps({"keys": [["a"]], "lengths": [[2]], "groups": [["zz"]]}))
    with pytest.raises(Exception, match="zz"):
        layout_from_json(str(path))


def test_flag_layout_is_torchrec_style_and_seeded():
    kw = dict(PRESETS["quick"])
    plain = layout_from_flags(**kw, duplicates=False, seed=3)
    dup = layout_from_flags(**kw, duplicates=True, seed=3)
    assert plain == layout_from_flags(**kw, duplicates=False, seed=3)
    assert not plain.has_duplicates and dup.has_duplicates
    assert sorted(k for g in plain.groups for k in g) == sorted(k for ks in plain.keys for k in ks)
    assert [g[:-1] for g in dup.groups] == plain.groups  # one extra key per group
    assert all(plain.groups)
    seed = layout_from_flags(**PRESETS["seed"], duplicates=False)
    assert seed.n_features == 1020 and seed.batch_size == 1024
    assert seed.out_bytes == seed.in_bytes == 1024 * (20 * 64 + 1000 * 128) * 4


def test_serving_preset_only_serving_rows(tmp_path):
    rc = main(["--preset", "serving", "--duplicates", "false", "--providers", "kt_regroup,limit",
               "--output", str(tmp_path), *FAST])
    assert rc == 0
    records = _load(str(tmp_path))["records"]
    assert {r["suite"] for r in records} == {"serving"}
    assert {r["grad_mode"] for r in records} == {"autograd", "inference_mode"}
    assert {r["batch_size"] for r in records} == {32}
    assert {r["n_features"] for r in records} == {27}
    assert all(r["calls_per_sample"] >= 1 for r in records)


def test_thp_run_happens_in_a_subprocess(tmp_path):
    rc = main(["--quick", "--allocator", "both", "--no_serving", "--run_backward", "false",
               "--duplicates", "false", "--providers", "KTRegroupAsDict,limit",
               "--output", str(tmp_path), *FAST])
    assert rc == 0
    records = _load(str(tmp_path))["records"]
    assert {r["allocator"] for r in records} == {"default", "thp"}
    thp = _load(str(tmp_path / "thp"))
    assert all(r["allocator"] == "thp" for r in thp["records"])
    assert not any(r["family"] == "fbgemm" for r in thp["records"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_says_so(tmp_path, capsys):
    assert main(["--device_type", "cuda", "--output", str(tmp_path)]) == 2
    assert "no CUDA" in capsys.readouterr().err


def test_percentile_matches_linear_interpolation():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([5.0], 90) == 5.0


@pytest.mark.skipif(not RssPeakProbe.available(), reason="needs Linux /proc/self/clear_refs")
def test_rss_probe_sees_a_fresh_allocation():
    probe = RssPeakProbe()
    probe.start()
    x = torch.ones(16 * 2**20)  # 64 MiB, every page touched
    peak = probe.stop()
    del x
    assert peak >= 60 * 2**20


def test_time_limit_keeps_one_sample_per_provider():
    import time

    from kt_regroup.bench.harness import NoMemoryProbe, run_cell
    from kt_regroup.bench.providers import FORWARD, Cell, make_providers

    layout = layout_from_flags(**PRESETS["quick"], duplicates=False)
    cell = Cell(layout, torch.device("cpu"), FORWARD)
    providers = make_providers(torch.device("cpu"))
    records = run_cell(cell, providers, repeats=50, min_repeats=50, budget_s=10.0,
                       probe=NoMemoryProbe(), slow_history={}, deadline=time.perf_counter())
    assert len(records) == len(providers)
    for r in records:
        assert r["n"] == 1 and r["cut_by_time_limit"], (r["provider"], r["n"])
        assert r["check"] == "ok"
