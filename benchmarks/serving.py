"""Serving as deployed: the over-arch-input model of examples/deploy.py, per request.

The model builds two ``KeyedTensor`` s from its two input tensors and regroups them, in
two layouts: ``serving`` (27 keys) and ``narrow`` (100 keys of 8-16 columns; also in
bf16, eager only). Forms:
Python eager; an AOTInductor package (``aoti_load_package``); with ``--full`` also traced
with torchrec's fx tracer, scripted, saved and loaded (``torch.jit.load``), and the
scripted file called from C++ (examples/cpp_predictor, built with cmake when cmake is
there). Rows: kt_regroup, torchrec's module in the same form, and a clone of the outputs;
in eager also the module on ready KeyedTensors, the bare op and
``permute_multi_embedding_into`` with warm outputs, to show what each layer adds.
"""

import os
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

from benchmarks.harness import NARROW, SERVING, interleaved, make_layout, median, segments

KT, TORCHREC, CLONE = "kt_regroup", "torchrec.KTRegroupAsDict [fbgemm]", "clone of the outputs"
READY = "kt_regroup.KTRegroupAsDict (ready KeyedTensors)"
BARE = "kt_regroup op (bare)"
INTO = "kt_regroup op, permute_multi_embedding_into (warm outputs)"
# The serving layout (27 keys) and a narrow-key one, as CPU serving layouts go; the
# narrow one also in bf16 (16-byte copies), eager only.
LAYOUTS = {"serving": (SERVING, torch.float32), "narrow": (NARROW, torch.float32),
           "narrow bf16": (NARROW, torch.bfloat16)}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class OverArchInput(torch.nn.Module):
    """Two tensors in, two regrouped towers' inputs out (examples/deploy.py's model)."""

    def __init__(self, keys, lengths, regroup: torch.nn.Module) -> None:
        super().__init__()
        self.keys, self.lengths, self.regroup = keys, lengths, regroup

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        kts = [KeyedTensor(keys=self.keys[0], length_per_key=self.lengths[0], values=dense),
               KeyedTensor(keys=self.keys[1], length_per_key=self.lengths[1], values=sparse)]
        out = self.regroup(kts)
        return out["group_0"], out["group_1"]


class CloneOutputs(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return a.clone(), b.clone()


def _models(keys, lengths, groups) -> Dict[str, torch.nn.Module]:
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict

    import kt_regroup

    names = [f"group_{i}" for i in range(len(groups))]
    models = {KT: OverArchInput(keys, lengths, kt_regroup.KTRegroupAsDict(groups, names)),
              TORCHREC: OverArchInput(keys, lengths, TorchrecKTRegroupAsDict(groups, names))}
    for m in models.values():  # warm: the plan is cached before tracing or export
        m.eval()(*_inputs(lengths, 2))
    return models


def _inputs(lengths, batch: int, dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
    return [t.to(dtype) for t in _formula([(batch, sum(w)) for w in lengths])]


def _formula(shapes) -> List[torch.Tensor]:
    """The predictor's inputs: element i = i % 17 - 8 (exact in any copy)."""
    return [(torch.arange(b * w, dtype=torch.float32) % 17 - 8).reshape(b, w) for b, w in shapes]


def _checksums(outputs) -> List[int]:
    """What the predictor prints per output: sum of values weighted by i % 101 + 1."""
    return [int((o.double().flatten() * (torch.arange(o.numel(), dtype=torch.float64) % 101 + 1))
                .sum().item()) for o in outputs]


def _scripted(model: torch.nn.Module, path: str) -> torch.jit.ScriptModule:
    import torchrec.fx

    torch.jit.script(torchrec.fx.symbolic_trace(model)).save(path)
    return torch.jit.load(path)


def _aoti(model: torch.nn.Module, example: List[torch.Tensor], path: str) -> Callable:
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model, tuple(example),
                                  dynamic_shapes=tuple({0: batch} for _ in example))
    torch._inductor.aoti_compile_and_package(program, package_path=path)
    return torch._inductor.aoti_load_package(path)


def _predictor(out_dir: str):
    """examples/cpp_predictor built under build/predictor, or why not."""
    exe = os.path.join(REPO, "build", "predictor", "predictor")
    src = os.path.join(REPO, "examples", "cpp_predictor", "predictor.cpp")
    if os.path.exists(exe) and os.path.getmtime(exe) > os.path.getmtime(src):
        return exe, None
    if shutil.which("cmake") is None:
        return None, "cmake is not installed: no C++ rows"
    build = os.path.dirname(exe)
    log = os.path.join(out_dir, "predictor_build.log")
    with open(log, "w") as f:
        for cmd in (["cmake", "-S", os.path.dirname(src), "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                     f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                    ["cmake", "--build", build, "-j2"]):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                return None, f"the C++ predictor did not build: see {log}"
    return exe, None


def _cpp_call_s(exe: str, model: str, lib: str, shapes: List[str], calls: int):
    """Seconds per call in the predictor, and the output checksums it printed."""
    out = subprocess.run([exe, model, lib, *shapes, "--calls", str(calls)], capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    lines = out.stdout.splitlines()
    per_call = [ln for ln in lines if ln.startswith("per call:")]
    if out.returncode != 0 or not per_call:
        raise RuntimeError(((out.stderr or out.stdout).strip().splitlines() or [
            f"exit {out.returncode}"])[-1][:200])
    sums = [int(ln.split()[-1]) for ln in lines if ln.startswith("output ")]
    return float(per_call[0].split()[2]) * 1e-6, sums


def _check(fn, want) -> str:
    got = fn()
    return "ok" if all(torch.equal(a, b) for a, b in zip(got, want)) else "mismatch"


def _build(form: str, model: torch.nn.Module, example: List[torch.Tensor], path: str):
    """``model`` in ``form``: a callable, or for C++ the saved file (the predictor loads it)."""
    if form == "eager":
        return model
    if form == "aoti":
        return _aoti(model, [a[:4] for a in example], path + ".pt2")
    scripted = _scripted(model, path + ".pt")
    return path + ".pt" if form == "c++ scripted" else scripted


def run(*, quick: bool, full: bool = False, out_dir: str) -> Dict[str, object]:
    """Both layouts at B=32 and B=512. Forms: eager, and AOTInductor for the serving
    layout (default); eager and scripted (``quick``); eager, scripted, AOTInductor and C++
    for both layouts (``full``)."""
    exe, why = _predictor(out_dir) if full else (None, None)
    notes = [why] if why else []
    forms = (["eager", "scripted"] if quick else ["eager"] + (["scripted"] if full else [])
             + ["aoti"] + (["c++ scripted"] if exe else []))
    records = []
    if not (quick or full):
        notes.append("torchrec's module is not compiled with AOTInductor in the default run "
                     "(a compile per layout, and milliseconds a call: see --full)")
        notes.append("the narrow layout runs eager only in the default run (AOTInductor "
                     "compiles per model: see --full)")
    for name, (sizes, dtype) in LAYOUTS.items():
        layout_forms = (["eager"] if dtype != torch.float32
                        else forms if name == "serving" or quick or full else ["eager"])
        records += _run_layout(name, sizes, dtype, layout_forms, quick, full, exe, out_dir)
    return {"records": records, "notes": notes}


def _run_layout(layout, sizes, dtype, forms, quick, full, exe, out_dir) -> List[dict]:
    import kt_regroup

    keys, lengths, groups = make_layout(**sizes, scattered=True, duplicates=False)
    plan = kt_regroup.get_plan(keys, lengths, groups)
    models = {**_models(keys, lengths, groups), CLONE: CloneOutputs()}
    rounds, target = (2, 0.002) if quick else (7, 0.05)  # seconds of calls per sample
    with torch.inference_mode():
        outputs = {b: [t.clone() for t in models[KT](*_inputs(lengths, b, dtype))]
                   for b in (32, 512)}
    built: Dict[str, Dict[str, object]] = {f: {} for f in forms}
    errors: Dict[str, Dict[str, str]] = {f: {} for f in forms}
    for form in forms:  # each model in each form once: every batch size calls it
        print(f"[bench] serving: {layout} layout, building {form}", file=sys.stderr, flush=True)
        for name, model in models.items():
            if form == "aoti" and name == TORCHREC and not full:
                continue
            example = outputs[32] if name == CLONE else _inputs(lengths, 32, dtype)
            try:
                built[form][name] = _build(form, model, example, os.path.join(
                    out_dir, f"serving_{layout}_{name.split('.')[0].split()[0]}"))
            except Exception as e:  # noqa: BLE001  (a form a peer lacks: reported)
                errors[form][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    records = []
    for batch in (32, 512):
        inputs, want = _inputs(lengths, batch, dtype), outputs[batch]
        for form in forms:
            args = {name: want if name == CLONE else inputs for name in built[form]}
            if form == "c++ scripted":
                fns = {n: (f, [f"{a.shape[0]}x{a.shape[1]}" for a in args[n]])
                       for n, f in built[form].items()}
            else:
                fns = {n: (lambda f=f, a=args[n]: f(*a)) for n, f in built[form].items()}
            if form == "eager":  # what the module adds to the bare op, and to _into
                ready = [KeyedTensor(keys=k, length_per_key=w, values=v)
                         for k, w, v in zip(keys, lengths, inputs)]
                module, tensors = models[KT].regroup, plan.tensors()
                warm = [torch.zeros_like(t) for t in want]
                fns[READY] = lambda m=module, r=ready: tuple(m(r).values())
                fns[BARE] = lambda i=inputs, t=tensors: torch.ops.kt_regroup.permute_multi_embedding(
                    i, *t, list(plan.out_lengths))
                fns[INTO] = lambda i=inputs, t=tensors, w=warm: (
                    torch.ops.kt_regroup.permute_multi_embedding_into(i, *t, w), w)[1]
            records += _time_form(form, batch, fns, dict(errors[form]), want, rounds, target,
                                  exe)
    for r in records:
        r.update(layout=layout, dtype=str(dtype).replace("torch.", ""),
                 keys=sum(len(k) for k in keys), segments=segments(plan),
                 threads=torch.get_num_threads())
    return records


def _time_form(form, batch, fns, errors, want, rounds, target, exe) -> List[dict]:
    import kt_regroup

    checks, samples, calls = {}, {}, {}
    with torch.inference_mode():
        if form == "c++ scripted":
            import fbgemm_gpu

            # the op library each model needs, loaded by the predictor (no Python there)
            libs = {n: kt_regroup.library_path() for n in fns}
            libs[TORCHREC] = os.path.join(os.path.dirname(fbgemm_gpu.__file__), "fbgemm_gpu_py.so")
            for name, (model, shapes) in fns.items():
                # the clone model gets the predictor's own inputs, of the outputs' shapes
                expect = _checksums(_formula([tuple(t.shape) for t in want]) if name == CLONE
                                    else want)
                try:
                    one, sums = _cpp_call_s(exe, model, libs[name], shapes, 10)
                    calls[name] = max(10, int(target / max(one, 1e-7)))
                    checks[name] = "ok" if sums == expect else f"mismatch: {sums} != {expect}"
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    errors[name] = str(e)
            samples = {n: [] for n in calls}
            for _ in range(rounds):  # interleaved: one process per sample
                for name in calls:
                    model, shapes = fns[name]
                    samples[name].append(_cpp_call_s(exe, model, libs[name], shapes,
                                                     calls[name])[0])
        else:
            for name, fn in list(fns.items()):
                try:
                    checks[name] = _check(fn, want)
                    one = min(interleaved({name: fn}, 3, warmup=1)[name])
                    calls[name] = max(1, int(target / max(one, 1e-7)))
                except Exception as e:  # noqa: BLE001  (a peer that fails here: reported)
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    del fns[name]
            samples = interleaved(fns, rounds, number=calls, warmup=0)
    clone = median(samples.get(CLONE, []))
    out = []
    for name in list(samples) + list(errors):
        call = median(samples.get(name, []))
        out.append({"form": form, "batch_size": batch, "provider": name, "call_s": call,
                    "samples_s": samples.get(name, []), "calls": f"{calls.get(name, 0)} x "
                    f"{len(samples.get(name, []))}", "vs_clone": call / clone if call and clone
                    else None, "check": errors.get(name) or checks.get(name, "")})
    return out
