"""Plumbing of ``python -m kt_regroup.bench``: layouts, gradients, records, files.

No timing assertions: only that every row ran, answered right, and was reported.
"""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchrec")

import kt_regroup  # noqa: E402
from kt_regroup.bench import main  # noqa: E402
from kt_regroup.bench.harness import RssPeakProbe  # noqa: E402
from kt_regroup.bench.layout import (  # noqa: E402
    PRESETS,
    layout_from_flags,
    layout_from_json,
)
from kt_regroup.bench.providers import (  # noqa: E402
    FORWARD,
    FORWARD_BACKWARD,
    GRADS,
    Cell,
    make_grad_outputs,
    make_providers,
)
from kt_regroup.bench.report import CSV_FIELDS, SCHEMA  # noqa: E402

# min_run_time 0: each provider is timed by its one (checked) call: seconds, not minutes
FAST = ["--no_progress", "--min_run_time", "0", "--serving_min_run_time", "0"]
RECORD_FIELDS = {
    "suite", "allocator", "layout", "segments", "mode", "grad", "grad_mode", "duplicates",
    "provider", "family", "batch_size", "n_features", "dtype", "device", "device_name", "threads",
    "samples_s", "n", "calls_per_sample", "warmup", "p50_s", "p90_s", "p50_ms", "p90_ms",
    "mem_peak_mb", "gbps", "bytes_moved", "vs_clone", "vs_copy", "vs_kt_regroup", "check",
    "error",
}
CPU = torch.device("cpu")


def _load(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    rc = main(["--quick", "--allocator", "default", "--layout", "scattered,seed",
               "--grad", "ones,expanded,randn",
               "--output", str(out), *FAST])
    return rc, str(out)


def test_quick_preset_exits_zero_and_writes_every_file(quick_run):
    rc, out = quick_run
    assert rc == 0
    for name in ("results.json", "results.csv", "runtime.png", "table.md"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "runtime.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_every_cell_and_every_provider_answers_right(quick_run):
    _, out = quick_run
    data = _load(out)
    assert data["schema"] == SCHEMA
    for key in ("torch", "fbgemm_gpu", "torchrec", "kt_regroup"):
        assert data["versions"][key]
    assert data["device"]["type"] == "cpu" and data["device"]["name"]
    assert data["threads"] == torch.get_num_threads()
    assert data["memory_method"]
    assert len(data["load_average"]) == 2
    records = data["records"]
    main_cells = {(r["layout"], r["mode"], r["grad"], r["duplicates"])
                  for r in records if r["suite"] == "main"}
    expected = {(lay, FORWARD, None, d) for lay in ("scattered", "seed") for d in (False, True)}
    expected |= {(lay, FORWARD_BACKWARD, g, d)
                 for lay in ("scattered", "seed") for g in GRADS for d in (False, True)}
    assert main_cells == expected
    serving = {(r["grad_mode"], r["duplicates"]) for r in records if r["suite"] == "serving"}
    assert serving == {
        (g, d) for g in ("autograd", "no_grad", "inference_mode") for d in (False, True)
    }
    assert {"kt_regroup", "torchrec", "fbgemm", "limit"} <= {r["family"] for r in records}
    for r in records:
        assert RECORD_FIELDS <= set(r), RECORD_FIELDS - set(r)
        # the first call of every row is checked against torchrec's cat path (and, in
        # forward+backward, its autograd): outputs bit-exact, gradients to rounding
        assert r["error"] is None, (r["provider"], r["error"])
        assert r["check"] == "ok", (r["provider"], r["layout"], r["grad"], r["check"])
        assert r["n"] == len(r["samples_s"]) >= 1
        assert r["p50_s"] <= r["p90_s"]
        assert r["vs_clone"] is not None and r["vs_kt_regroup"] is not None
        if r["provider"].startswith("kt_regroup.KTRegroupAsDict"):
            assert r["vs_kt_regroup"] == pytest.approx(1.0)
    main_rows = [r for r in records if r["suite"] == "main"]
    assert all(r["mem_peak_mb"] is not None for r in main_rows) == RssPeakProbe.available()
    kt_fb = [r for r in main_rows if r["mode"] == FORWARD_BACKWARD and r["family"] == "kt_regroup"]
    assert {r["grad"] for r in kt_fb} == set(GRADS)
    # an expanded upstream gradient is one element: the backward reads (almost) nothing
    moved = {(r["grad"], r["layout"], r["duplicates"]): r["bytes_moved"] for r in kt_fb}
    for (grad, lay, dup), b in moved.items():
        if grad == "expanded":
            assert b < moved[("ones", lay, dup)] == moved[("randn", lay, dup)]


def test_csv_has_one_row_per_record_with_versions(quick_run):
    _, out = quick_run
    records = _load(out)["records"]
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == CSV_FIELDS
    assert len(rows) == len(records)
    assert {row["torch"] for row in rows} == {torch.__version__}
    assert {row["provider"] for row in rows} == {r["provider"] for r in records}
    assert {row["grad"] for row in rows} == {"", *GRADS}


def test_table_is_in_the_seed_style_without_internal_targets(quick_run):
    _, out = quick_run
    with open(os.path.join(out, "table.md")) as f:
        table = f.read()
    assert "| provider | B | F | device | Runtime (P50) | Runtime (P90) |" in table
    assert "limit: clone_dup" in table and "limit: copy_" in table and "/ kt_regroup" in table
    assert "expanded gradients, scattered layout" in table
    for word in ("goal", "issue", "acceptance", "target", "met)", "missed"):
        assert word not in table.lower(), word
    assert "goals" not in _load(out)


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
    assert layout.segments == 5  # u1 after i3, i1 after u2, u1 again: nothing merges
    out = tmp_path / "out"
    # a small min_run_time: the torch.utils.benchmark path (blocks of calls)
    rc = main(["--layout", str(path), "--allocator", "default", "--no_serving", "--grad",
               "randn", "--providers", "kt_regroup,_regroup_keyed,limit", "--output", str(out),
               "--no_progress", "--min_run_time", "0.02"])
    assert rc == 0
    records = _load(str(out))["records"]
    assert {r["batch_size"] for r in records} == {5}
    assert {r["n_features"] for r in records} == {5}
    assert {r["duplicates"] for r in records} == {True}
    assert {r["family"] for r in records} == {"kt_regroup", "torchrec", "limit"}
    assert all(r["check"] == "ok" and r["error"] is None for r in records)
    blocked = [r for r in records if r["warmup"] == "discarded"]  # first call < min_run_time
    assert blocked and all(r["calls_per_sample"] >= 1 for r in blocked)


def test_layout_file_errors_name_the_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"keys": [["a"]], "lengths": [[2]]}))
    with pytest.raises(ValueError, match="groups"):
        layout_from_json(str(path))
    path.write_text(json.dumps({"keys": [["a"]], "lengths": [[2]], "groups": [["zz"]]}))
    with pytest.raises(Exception, match="zz"):
        layout_from_json(str(path))


def test_bad_layout_or_grad_name_is_a_clear_cli_error(capsys):
    with pytest.raises(SystemExit):
        main(["--layout", "sorted"])
    assert "--layout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--grad", "ones,zeros"])
    assert "--grad" in capsys.readouterr().err


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


@pytest.mark.parametrize("duplicates", [False, True])
def test_scattered_layout_is_seeded_and_scattered(duplicates):
    kw = dict(PRESETS["seed"], duplicates=duplicates)
    seed = layout_from_flags(**kw, allocation="seed")
    scattered = layout_from_flags(**kw, allocation="scattered")
    assert scattered == layout_from_flags(**kw, allocation="scattered")  # fixed seed
    assert scattered != layout_from_flags(**kw, allocation="scattered", seed=1)
    assert scattered.name == "scattered" and scattered.has_duplicates == duplicates
    # the seed's key counts and widths, each key in one random group ...
    assert (scattered.keys, scattered.lengths, scattered.batch_size) == (
        seed.keys, seed.lengths, seed.batch_size)
    # the same allocation of keys to groups as the seed layout (the extra keys differ)
    drop = int(duplicates)
    assert [set(g[: len(g) - drop]) for g in scattered.groups] == [
        set(g[: len(g) - drop]) for g in seed.groups]
    assert scattered.groups != seed.groups
    # ... in an order that almost never keeps input neighbours together
    entries = sum(len(g) for g in scattered.groups)
    assert scattered.segments >= 0.98 * entries
    assert seed.segments <= 0.6 * entries  # the seed's input order merges about half
    assert scattered.segments >= 1.8 * seed.segments
    if duplicates:
        plain = layout_from_flags(**dict(kw, duplicates=False), allocation="scattered")
        assert [g[:-1] for g in scattered.groups] == plain.groups


def test_segments_are_the_plan_rows_merged_where_they_continue_each_other():
    for allocation in ("seed", "scattered"):
        lay = layout_from_flags(**PRESETS["quick"], duplicates=True, allocation=allocation)
        rows = kt_regroup.get_plan(lay.keys, lay.lengths, lay.groups).rows
        merged = sum(
            1 for i, r in enumerate(rows)
            if r[4] > 0 and r[5] == 0 and i > 0 and rows[i - 1][5] == 0
            and rows[i - 1][:2] == r[:2] and rows[i - 1][2] + rows[i - 1][4] == r[2]
            and rows[i - 1][3] + rows[i - 1][4] == r[3]
        )
        assert len(rows) - merged == lay.segments


@pytest.mark.parametrize("grad", GRADS)
def test_grad_modes_reach_the_regroup_as_asked(grad):
    layout = layout_from_flags(**PRESETS["quick"], duplicates=True, allocation="scattered")
    cell = Cell(layout, CPU, FORWARD_BACKWARD, grad)
    assert len(cell.grad_outputs) == len(layout.groups)
    for g, e in zip(cell.grad_outputs, cell.expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        if grad == "expanded":  # what loss = out.sum() hands back
            assert g.stride() == (0, 0)
        else:
            assert g.is_contiguous()
        assert torch.equal(g, torch.ones_like(e)) == (grad != "randn")
    module = kt_regroup.KTRegroupAsDict(layout.groups, cell.group_names)
    seen = []
    out = module(cell.kts)
    outs = [out[n] for n in cell.group_names]
    for o in outs:
        o.register_hook(lambda g: seen.append(g.stride()))
    grads = cell.input_grads(outs)
    if grad == "expanded":
        assert seen == [(0, 0)] * len(outs)  # not materialised on the way to kt_regroup
    else:
        assert all(s[1] == 1 and s[0] > 0 for s in seen)
    assert cell.check((outs, grads)) == "ok"
    # the check can fail: one wrong element of a gradient or of an output is caught
    bad = [g.clone() for g in grads]
    bad[-1][-1, -1] += 1
    assert cell.check((outs, bad)) == f"gradient mismatch in input {len(bad) - 1}"
    wrong = [o.detach().clone() for o in outs]
    wrong[0][0, 0] += 1
    assert cell.check((wrong, grads)) == "mismatch in group 0"


def test_make_grad_outputs_rejects_unknown_modes():
    with pytest.raises(ValueError, match="zeros"):
        make_grad_outputs("zeros", [(2, 3)], torch.float32, CPU)


def test_serving_preset_only_serving_rows(tmp_path):
    rc = main(["--preset", "serving", "--duplicates", "false", "--providers", "kt_regroup,limit",
               "--output", str(tmp_path), "--no_progress", "--serving_min_run_time", "0.002"])
    assert rc == 0
    records = _load(str(tmp_path))["records"]
    assert {r["suite"] for r in records} == {"serving"}
    assert {r["grad_mode"] for r in records} == {"autograd", "no_grad", "inference_mode"}
    assert {r["batch_size"] for r in records} == {32}
    assert {r["n_features"] for r in records} == {27}
    assert all(r["calls_per_sample"] >= 1 and r["check"] == "ok" for r in records)


def test_thp_run_happens_in_a_subprocess(tmp_path):
    rc = main(["--quick", "--allocator", "both", "--no_serving", "--run_backward", "false",
               "--duplicates", "false", "--providers", "KTRegroupAsDict,limit",
               "--output", str(tmp_path), *FAST])
    assert rc == 0
    records = _load(str(tmp_path))["records"]
    assert {r["allocator"] for r in records} == {"default", "thp"}
    thp = _load(str(tmp_path / "thp"))
    assert thp["records"] and all(r["allocator"] == "thp" for r in thp["records"])
    assert not any(r["family"] == "fbgemm" for r in thp["records"])
    assert {r["layout"] for r in thp["records"]} == {"scattered"}  # the first layout only


def test_time_limit_times_each_provider_once(tmp_path):
    rc = main(["--quick", "--allocator", "default", "--no_serving", "--time_limit_s", "1e-9",
               "--duplicates", "false", "--grad", "expanded", "--output", str(tmp_path),
               "--no_progress", "--min_run_time", "5"])
    assert rc == 0
    data = _load(str(tmp_path))
    assert data["records"]
    for r in data["records"]:
        assert r["n"] == 1 and r["warmup"] == "counted" and r["check"] == "ok", r["provider"]
    assert any("behind the --time_limit_s plan" in note for note in data["notes"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_says_so(tmp_path, capsys):
    assert main(["--device_type", "cuda", "--output", str(tmp_path)]) == 2
    assert "no CUDA" in capsys.readouterr().err


def test_importing_the_benchmark_never_initialises_cuda():
    code = (
        "import torch, kt_regroup.bench\n"
        "from kt_regroup.bench import cli, harness, layout, providers, report\n"
        "cli.build_parser().parse_args(['--device_type', 'cuda'])\n"
        "providers.make_providers(torch.device('cpu'))\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_only_rows_are_absent_on_cpu():
    names = [p.name for p in make_providers(CPU)]
    assert not any("triton_permute_multi_embedding" in n for n in names)


@pytest.mark.skipif(not RssPeakProbe.available(), reason="needs Linux /proc/self/clear_refs")
def test_rss_probe_sees_a_fresh_allocation():
    probe = RssPeakProbe()
    probe.start()
    x = torch.ones(16 * 2**20)  # 64 MiB, every page touched
    peak = probe.stop()
    del x
    assert peak >= 60 * 2**20
