"""Smoke test of ``python -m benchmarks.regroup --quick`` (``make bench``), run as users
run it: a fresh process from the repository root. No timing assertions: every section
ran, every row answered as the reference does, and the report holds together."""

import ctypes.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchrec")

from benchmarks import ops, serving, step  # noqa: E402
from benchmarks.harness import SEED, device_interleaved, make_layout  # noqa: E402
from benchmarks.regroup import ALLOCATORS, SCHEMA  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.regroup", "--quick", "--output", str(out),
         "--child-env", "KT_REGROUP_HUGE_PAGES=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "results.json") as f:
        return json.load(f), proc.stdout, out


def test_writes_json_markdown_and_one_png(quick):
    data, stdout, out = quick
    assert data["schema"] == SCHEMA
    assert set(data["sections"]) == {"step", "serving", "ops"}
    for key in ("torch", "torchrec", "fbgemm_gpu", "kt_regroup"):
        assert data["machine"]["versions"][key]
    with open(out / "step.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(out / "results.md") as f:
        table = f.read()
    assert table.strip() in stdout
    last = stdout.rstrip().splitlines()[-1]  # where the results went
    assert last.startswith("results: ") and str(out / "results.json") in last
    assert str(out / "step.png") in last
    assert "### training step, scattered" in table and "| row | step ms |" in table
    assert "### serving, scripted, narrow layout, B=32" in table and "### op alone, forward," in table


def test_step_rows_under_each_allocator(quick):
    data, _, _ = quick
    sec = data["sections"]["step"]
    records = sec["records"]
    for name, (lib, _) in ALLOCATORS.items():
        ran = {r["allocator"] for r in records}
        # the child reports the malloc it found in its own /proc/self/maps
        if lib is None or ctypes.util.find_library(lib):
            assert name in ran, (name, sec["notes"])
        else:
            assert name not in ran and any(n.startswith(name) for n in sec["notes"])
    assert {r["env"] for r in records} == {"KT_REGROUP_HUGE_PAGES=0"}  # seen by the child
    for alloc in dict.fromkeys(r["allocator"] for r in records):
        mine = [r for r in records if r["allocator"] == alloc]
        first = alloc == records[0]["allocator"]  # only it runs every variant and FBGEMM
        variants = ["scattered", "scattered+dup+sum", "scattered+vbe"] if first else ["scattered"]
        assert list(dict.fromkeys(r["variant"] for r in mine)) == variants
        for i, variant in enumerate(variants):
            rows = {r["provider"]: r for r in mine if r["variant"] == variant}
            if "+vbe" in variant:  # its own rows, checked against unpatched torchrec
                assert set(rows) == set(step.VBE_ROWS)
                for r in rows.values():
                    assert r["n"] == len(r["samples_s"]) >= 1 and r["step_s"] > 0
                    assert r["peak_rss_bytes"] is not None and r["step_vs_index_select"] > 0
                    if r["provider"] != step.NONE:
                        assert r["check"] == "ok", (r["provider"], r["check"])
                assert rows[step.VBE_TODAY]["step_vs_ref"] == pytest.approx(1.0)
                continue
            assert set(rows) == (set(step.ROWS) - ({step.FBGEMM} if not first else set())
                                 if i == 0 else set(step.SHORT_ROWS))
            fallback = rows[step.FALLBACK]  # a ratio needs a positive share (noise: not)
            assert fallback["share_vs_fallback"] == (pytest.approx(1.0) if fallback["share_s"]
                                                     > 0 else None)
            assert rows[step.NONE]["share_s"] == 0.0
            for r in rows.values():
                assert r["n"] == len(r["samples_s"]) >= 1 and r["step_s"] > 0
                if r["provider"] != step.NONE:  # paired with the no-regroup step
                    assert len(r["share_samples_s"]) == r["n"]
                if r["provider"] not in (step.NONE, step.COPY_LIMIT):
                    assert r["check"].startswith("ok"), (r["provider"], r["check"])
            assert rows[step.KT]["grad"] == ("sum" if "+sum" in variant else "linear")
            assert rows[step.KT]["duplicates"] == ("+dup" in variant)


def test_serving_forms_and_rows(quick):
    data, _, _ = quick
    records = data["sections"]["serving"]["records"]
    cells = {(r["layout"], r["form"], r["batch_size"]) for r in records}
    assert cells == {(lay, f, b) for lay, (_, dtype) in serving.LAYOUTS.items()
                     for f in ("eager", "scripted") for b in (32, 512)
                     if f == "eager" or dtype == torch.float32}
    for layout, form, batch in cells:
        rows = {r["provider"]: r for r in records
                if (r["layout"], r["form"], r["batch_size"]) == (layout, form, batch)}
        want = {serving.KT, serving.TORCHREC, serving.CLONE}
        if form == "eager":  # what each layer adds: the module on ready inputs, op, _into
            want |= {serving.READY, serving.BARE, serving.INTO}
        assert want <= set(rows)
        assert rows[serving.CLONE]["vs_clone"] == pytest.approx(1.0)
        for r in rows.values():
            assert r["check"] == "ok", (layout, form, batch, r["provider"], r["check"])
            assert r["call_s"] > 0 and r["vs_clone"] > 0
        assert rows[serving.KT]["keys"] == {"serving": 27, "narrow": 100, "narrow bf16": 100}[layout]
        assert rows[serving.KT]["dtype"] == ("bfloat16" if "bf16" in layout else "float32")


def test_op_table_every_mode_and_provider(quick):
    data, _, _ = quick
    records = data["sections"]["ops"]["records"]
    assert {(r["mode"], r["duplicates"]) for r in records} == {
        (m, d) for m in ops.MODES for d in (False, True)} | {(m, False) for m in ops.VBE_MODES}
    for r in records:
        assert r["check"].startswith("ok"), (r["mode"], r["provider"], r["check"])
        assert r["p50_s"] <= r["p90_s"] and r["n"] == len(r["samples_s"]) >= 1
        assert r["vs_copy"] > 0
        if r["provider"] == ops.COPY:
            assert r["vs_copy"] == pytest.approx(1.0)
    fb = [r for r in records if r["mode"] not in ("forward", "vbe forward")
          and r["provider"] in (ops.KT, ops.VBE_OP, ops.VBE_INDEX)]
    assert {r["check"] for r in fb} == {"ok"} and len(fb) == 6  # gradients compared too


def test_op_table_vbe_rows(quick):
    data, stdout, _ = quick
    records = data["sections"]["ops"]["records"]
    for mode in ops.VBE_MODES:
        rows = {r["provider"]: r for r in records if r["mode"] == mode}
        assert list(rows) == [ops.VBE_OP, ops.VBE_INDEX, ops.COPY]
        assert {r["check"] for r in rows.values()} == {
            "ok", "ok" if mode == "vbe forward" else "ok (outputs; no gradient)"}
        assert rows[ops.VBE_OP]["vs_kt_regroup"] == pytest.approx(1.0)
        # QUICK at B=64: 3 dense keys x 8 at full batch, 24 sparse keys x 16 of 64 rows
        out, pooled = 64 * (3 * 8 + 24 * 16) * 4, (64 * 3 * 8 + 24 * 64 * 16) * 4
        want = 2 * out + (out + pooled if mode != "vbe forward" else 0)
        assert {r["bytes_moved"] for r in rows.values()} == {want}
        assert f"### op alone, {mode}, scattered (" in stdout


def test_op_table_on_cpu_has_no_device_time(quick):
    data, stdout, _ = quick
    for r in data["sections"]["ops"]["records"]:  # CUDA events only on CUDA
        assert r["device"] == "cpu" and r["device_batch"] is None
        for key in ("device_samples_s", "device_p50_s", "vs_copy_device", "graph_samples_s",
                    "graph_p50_s", "vs_copy_graph", "graph_error"):
            assert r[key] is None, key
    header = ("| provider | P50 ms | P90 ms | GB/s | / copy_ | / kt_regroup | device ms | graph ms "
              "| / copy_ device | / copy_ graph | n | check |")
    assert header in stdout
    ops_md = stdout[stdout.index("### op alone"):]
    rows = [ln for ln in ops_md.splitlines() if ln.startswith(f"| {ops.KT} |")]
    assert rows and all(ln.split(" | ")[6:10] == ["n/a"] * 4 for ln in rows), rows


def test_device_interleaved_on_cuda_times_calls_and_graphs():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: CUDA events and graphs")
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    fns = {"copy_": lambda: dst.copy_(src), "host sync": lambda: src.sum().item()}
    stream = torch.cuda.current_stream()
    eager, graph, errors = device_interleaved(fns, 3, batch=4)
    assert torch.cuda.current_stream() == stream  # a failed capture leaves no stream behind
    assert [len(eager[n]) for n in fns] == [3, 3] and all(t > 0 for ts in eager.values()
                                                         for t in ts)
    assert list(graph) == ["copy_"] and len(graph["copy_"]) == 3 and min(graph["copy_"]) > 0
    assert list(errors) == ["host sync"] and errors["host sync"]
    torch.testing.assert_close(dst, src)  # the replays did the copy


def test_layouts_are_seeded_and_cover_every_key():
    keys, lengths, groups = make_layout(**SEED, scattered=False, duplicates=False)
    flat = [k for ks in keys for k in ks]
    assert len(flat) == 1020 and sum(map(sum, lengths)) == 20 * 64 + 1000 * 128
    assert sorted(k for g in groups for k in g) == sorted(flat) and all(groups)
    assert all(g == sorted(g, key=flat.index) for g in groups)  # seed: input order
    scattered = make_layout(**SEED, scattered=True, duplicates=False)[2]
    assert [sorted(g) for g in scattered] == [sorted(g) for g in groups] != scattered
    dup = make_layout(**SEED, scattered=True, duplicates=True)[2]
    assert [g[:-1] for g in dup] == scattered
    assert make_layout(**SEED, scattered=True, duplicates=True)[2] == dup


def test_quick_and_full_are_exclusive():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.regroup", "--quick", "--full"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--full" in proc.stderr and "--quick" in proc.stderr


def test_bad_section_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.regroup", "--section", "steps"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--section" in proc.stderr and "steps" in proc.stderr
