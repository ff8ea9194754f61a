"""Hardening: one module shared by threads, races in the plan cache, careless calls.

Each test here failed before its fix (issue 8): wrong outputs across threads, a spurious
KeyError from the plan cache, silently regrouping along the wrong dimension, a plan
rebuilt on every call for tuple keys, and obscure errors for careless calls.
"""

import logging
import os
import random
import signal
import sys
import threading
import time

import pytest
import torch
from conftest import Layout, assert_same_list, expected_regroup, keyed_tensors, make_values
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup
from kt_regroup import plan as plan_module

KEYS = ["a", "b", "c", "d", "e", "f"]
WIDTHS = {"a": 64, "b": 128, "c": 32, "d": 96, "e": 128, "f": 64}
GROUPS = [["c", "a", "f"], ["e", "b", "a", "d"]]


def _layout(order):
    return Layout([list(order[:3]), list(order[3:])], [[WIDTHS[k] for k in order[:3]],
                  [WIDTHS[k] for k in order[3:]]], GROUPS)


def test_one_module_many_threads_different_key_orders():
    # 8 threads share one module; each has its own key order (so the plan is rebuilt
    # under the others' feet) and batch size; rows are wide enough (~2 KiB) and batches
    # large enough for the CPU kernel's parallel path. Every output must be right.
    # A short switch interval makes threads interleave between any two bytecodes.
    module = kt_regroup.KTRegroupAsDict(GROUPS, ["x", "y"])
    orders = [random.Random(t).sample(KEYS, len(KEYS)) for t in range(8)]
    inputs = []
    for t in range(8):
        layout = _layout(orders[t])
        batches = [64 + 131 * t + 300 * (i % 4) for i in range(4)]  # up to ~1.1k rows
        values = [make_values(layout, b, seed=t * 10 + i) for i, b in enumerate(batches)]
        inputs.append([(keyed_tensors(layout, v), expected_regroup(v, layout)) for v in values])
    failures: list = []
    start = threading.Barrier(8)
    threads_before, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(4)
    sys.setswitchinterval(1e-6)

    def work(t: int) -> None:
        start.wait()
        for i in range(150):
            kts, expected = inputs[t][i % 4]
            try:
                out = list(module(kts).values())
            except Exception as exc:  # noqa: BLE001  (an exception is a failure too)
                failures.append((t, i, repr(exc)[:200]))
                continue
            if not all(torch.equal(g, e) for g, e in zip(out, expected)):
                failures.append((t, i, "wrong values"))

    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        torch.set_num_threads(threads_before)
        sys.setswitchinterval(interval)
    assert failures == []


def test_plan_cache_under_concurrent_eviction():
    # Threads that miss at once used to evict the same oldest entry: KeyError. 8 threads x
    # 300 layouts of 2 widths each, through a cache of 128: evictions all the time.
    errors: list = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        start.wait()
        try:
            for i in range(300):
                widths = [1 + (t * 300 + i) % 997, 2 + i % 3]
                plan = kt_regroup.get_plan([["p", "q"]], [widths], [["q", "p"]])
                assert plan.out_lengths == (sum(widths),)
        except Exception as exc:  # noqa: BLE001  (any exception is the failure)
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    info = plan_module._cached.cache_info()
    assert info.currsize <= info.maxsize


def _kt(keys, widths, batch=3, key_dim=1):
    values = torch.randn(batch, sum(widths)) if key_dim == 1 else torch.randn(sum(widths), batch)
    return KeyedTensor(keys=keys, length_per_key=widths, values=values, key_dim=key_dim)


def test_mixed_key_dim_is_refused_everywhere():
    kts = [_kt(["a"], [2]), _kt(["b"], [3], key_dim=0)]
    match = r"same key_dim; input 1 has key_dim 0, input 0 has 1"
    with pytest.raises(ValueError, match=match):
        kt_regroup.regroup(kts, [["a", "b"]])
    with pytest.raises(ValueError, match=match):
        kt_regroup.KTRegroupAsDict([["a", "b"]], ["x"])(kts)
    # A module warmed on key_dim=1 inputs sees the change too.
    module = kt_regroup.KTRegroupAsDict([["a", "b"]], ["x"])
    module([_kt(["a"], [2]), _kt(["b"], [3])])
    with pytest.raises(ValueError, match=match):
        module(kts)


def test_tuple_keys_reuse_the_plan(caplog):
    module = kt_regroup.KTRegroupAsDict([["b", "a"]], ["x"])
    values = torch.randn(4, 5)
    kt = KeyedTensor(keys=("a", "b"), length_per_key=(2, 3), values=values)
    with caplog.at_level(logging.WARNING, logger="kt_regroup.module"):
        first = module([kt])["x"]
        plan = module._plan
        for _ in range(3):
            again = module([kt])["x"]
            assert module._plan is plan  # not rebuilt
    assert "changed" not in caplog.text
    assert torch.equal(first, again)
    assert torch.equal(first, torch.cat([values[:, 2:], values[:, :2]], 1))


def test_careless_calls_get_clear_errors():
    module = kt_regroup.KTRegroupAsDict([["a"]], ["x"])
    kt = _kt(["a", "b"], [1, 2])
    with pytest.raises(TypeError, match=r"list of KeyedTensors.*got dict"):
        module({"a": kt})
    with pytest.raises(TypeError, match=r"list of KeyedTensors.*got KeyedTensor"):
        module(kt)
    with pytest.raises(TypeError, match=r"keyed_tensors\[1\] is a Tensor"):
        module([kt, torch.ones(3, 1)])
    # The op schema refuses widths that are not ints, showing the value.
    with pytest.raises(RuntimeError, match=r"(?s)'List\[List\[int\]\]' for argument 'lengths'.*2\.7"):
        kt_regroup.get_plan([["a"]], [[2.7]], [["a"]])
    with pytest.raises(RuntimeError, match=r"(?s)'List\[List\[int\]\]' for argument 'lengths'.*'3'"):
        kt_regroup.get_plan([["a"]], [["3"]], [["a"]])
    p, i, o, _ = kt_regroup.kt_regroup_arguments(torch.empty(0), [["a"]], [[2]], [["a"]])
    backward = torch.ops.kt_regroup.permute_multi_embedding_backward
    with pytest.raises(ValueError, match=r"in_lengths\[0\] is negative \(-2\)"):
        backward([torch.ones(3, 2)], p, i, o, [-2], 3, torch.float32)
    with pytest.raises(ValueError, match=r"batch_size is negative \(-3\)"):
        backward([None], p, i, o, [2], -3, torch.float32)


def test_module_moved_to_meta_and_back_with_to_empty():
    # A plan built on meta (meta init), then the module materialised with to_empty():
    # the plan's buffers would hold garbage; the module must still regroup right.
    layout = Layout([["a", "b"], ["c"]], [[3, 7], [5]], [["c", "a"], ["b"]])
    module = kt_regroup.KTRegroupAsDict(layout.groups, ["x", "y"])
    meta_values = [torch.empty(2, w, device="meta") for w in layout.in_widths]
    out = module(keyed_tensors(layout, meta_values))
    assert out["x"].device.type == "meta"
    values = make_values(layout, 4)
    assert_same_list(list(module(keyed_tensors(layout, values)).values()),
                     expected_regroup(values, layout))
    module.to("meta")
    module.to_empty(device="cpu")
    assert_same_list(list(module(keyed_tensors(layout, values)).values()),
                     expected_regroup(values, layout))


# --- mixed input dtypes (issue 9): quantized embeddings next to fp32 dense features ------


def _mixed_inputs(batch=5):
    dense = KeyedTensor(keys=["d0", "d1"], length_per_key=[3, 4],
                        values=torch.randn(batch, 7, dtype=torch.float64).float())
    fp16 = KeyedTensor(keys=["s0", "s1"], length_per_key=[8, 2],
                       values=torch.randn(batch, 10, dtype=torch.float64).half())
    bf16 = KeyedTensor(keys=["s2"], length_per_key=[6],
                       values=torch.randn(batch, 6, dtype=torch.float64).bfloat16())
    return [dense, fp16, bf16]


MIXED_GROUPS = [["s1", "d0", "s2", "s1"], ["d1", "s0"]]


def _mixed_expected(kts, dtype):
    blocks = {k: v.to(dtype) for kt in kts for k, v in kt.to_dict().items()}
    return [torch.cat([blocks[k] for k in g], 1) for g in MIXED_GROUPS]


@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_module_with_emb_dtype_casts_mixed_inputs_in_the_copy(emb_dtype):
    from torchrec.modules.embedding_configs import dtype_to_data_type
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict

    kts = _mixed_inputs()
    ours = kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"], emb_dtype=emb_dtype)(kts)
    theirs = TorchrecKTRegroupAsDict(
        MIXED_GROUPS, ["x", "y"], emb_dtype=dtype_to_data_type(emb_dtype)
    )(kts)
    assert_same_list(list(ours.values()), _mixed_expected(kts, emb_dtype))
    assert_same_list(list(ours.values()), list(theirs.values()))


def test_mixed_inputs_gradients_come_back_in_each_inputs_dtype():
    kts = _mixed_inputs()
    leaves = [kt.values().detach().requires_grad_() for kt in kts]
    kts = [KeyedTensor(kt.keys(), kt.length_per_key(), v) for kt, v in zip(kts, leaves)]
    out = kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"], emb_dtype=torch.float32)(kts)
    (out["x"].sum() + 2 * out["y"].sum()).backward()
    assert [v.grad.dtype for v in leaves] == [torch.float32, torch.float16, torch.bfloat16]
    # s1 (fp16 input 1, columns 8:10) is used twice in group x; s0 once in y (weight 2).
    assert torch.equal(leaves[1].grad[:, 8:], torch.full((5, 2), 2.0, dtype=torch.float16))
    assert torch.equal(leaves[1].grad[:, :8], torch.full((5, 8), 2.0, dtype=torch.float16))


def test_mixed_inputs_without_emb_dtype():
    kts = _mixed_inputs()
    # torchrec's KeyedTensor.regroup promotes (torch.cat): so does kt_regroup.regroup.
    promoted = KeyedTensor.regroup(kts, MIXED_GROUPS)
    ours = kt_regroup.regroup(kts, MIXED_GROUPS)
    assert [o.dtype for o in ours] == [torch.float32, torch.float32]
    assert_same_list(ours, promoted)
    # torchrec's module refuses them (a dtype error from FBGEMM): ours says what to do.
    with pytest.raises(TypeError, match=r"set emb_dtype"):
        kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"])(kts)


def test_mixed_inputs_through_fx_script_and_export():
    import torchrec.fx

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.regroup = kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"], emb_dtype=torch.float32)

        def forward(self, dense: torch.Tensor, fp16: torch.Tensor, bf16: torch.Tensor):
            kts = [
                KeyedTensor(keys=["d0", "d1"], length_per_key=[3, 4], values=dense),
                KeyedTensor(keys=["s0", "s1"], length_per_key=[8, 2], values=fp16),
                KeyedTensor(keys=["s2"], length_per_key=[6], values=bf16),
            ]
            out = self.regroup(kts)
            return out["x"], out["y"]

    kts = _mixed_inputs(batch=6)
    args = tuple(kt.values() for kt in kts)
    model = Model()
    expected = _mixed_expected(kts, torch.float32)
    assert_same_list(list(model(*args)), expected)
    scripted = torch.jit.script(torchrec.fx.symbolic_trace(model))
    assert_same_list(list(scripted(*args)), expected)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, args, dynamic_shapes=({0: batch},) * 3)
    assert_same_list(list(program.module()(*args)), expected)


def test_plan_cache_survives_fork_while_another_thread_misses():
    # A lock held by a thread at fork() stays held forever in the child: children
    # deadlocked in get_plan. The cache takes no lock of ours.
    stop = threading.Event()

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            kt_regroup.get_plan([["p", "q"]], [[1 + i % 5000, 2]], [["q", "p"]])
            i += 1

    thread = threading.Thread(target=hammer)
    thread.start()
    stuck = 0
    try:
        for n in range(40):
            pid = os.fork()
            if pid == 0:  # the child: misses and hits, then leaves at once
                try:
                    plan = kt_regroup.get_plan([["a"]], [[3 + n]], [["a", "a"]])
                    os._exit(0 if plan.out_lengths == (6 + 2 * n,) else 1)
                finally:
                    os._exit(2)
            deadline = time.monotonic() + 20
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    stuck += 1
                    break
                time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert stuck == 0
