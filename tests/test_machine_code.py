"""The CPU copy programs' machine code (``kt_regroup/csrc/machine_code.cpp``).

Emitted code is disassembled by GNU objdump (binutils, which the library's build needs
anyway) and compared, instruction by instruction, with what the program must be: an
``endbr64``, the callee-saved registers pushed, one row pointer per tensor loaded, per
copy a load and a store for each chunk (32, 16, 8, 4, 2 then 1 bytes), every pointer
stepped one row, the loop, ``vzeroupper``, the pops and ``ret``. The end-to-end copies
are tested in test_cpu_kernel.py.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess

import pytest
import torch

MACHINE_CODE = torch.ops.kt_regroup._cpu_machine_code

# The row pointer of the k-th tensor (in order of first use, each copy's input, then its
# output) and the names of rax's and ymm0's parts by move size.
REGS = ["rcx", "r8", "r9", "r10", "r11", "rbx", "rbp", "r13", "r14", "r15"]
CALLEE_SAVED = {"rbx", "rbp", "r13", "r14", "r15"}
DATA = {1: ("al", "BYTE"), 2: ("ax", "WORD"), 4: ("eax", "DWORD"), 8: ("rax", "QWORD"),
        16: ("xmm0", "XMMWORD"), 32: ("ymm0", "YMMWORD")}


def _code(copies) -> bytes:
    flat = [v for c in copies for v in c]
    return MACHINE_CODE(flat).numpy().tobytes()


needs_machine_code = pytest.mark.skipif(
    not _code([(0, 0, 0, 0, 1)]),
    reason="no machine code here (x86-64 Linux with AVX2 and KT_REGROUP_JIT unset only)")


def _disassemble(code: bytes, tmp_path) -> list:
    """``(address, mnemonic, operands)`` per instruction, from objdump."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (GNU binutils, which the build needs) is not on PATH"
    path = tmp_path / "code.bin"
    path.write_bytes(code)
    out = subprocess.run(
        [objdump, "-D", "-b", "binary", "-m", "i386:x86-64", "-M", "intel",
         "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True).stdout
    listing = []
    for line in out.splitlines():
        found = re.match(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$", line)
        if found:
            listing.append((int(found.group(1), 16), found.group(2), found.group(3).strip()))
    return listing


def _expected(copies) -> list:
    """``(mnemonic, operands)`` of the program, with the loop's target as ``"TOP"``."""
    tensors = []
    for in_t, out_t, *_ in copies:
        for key in ((in_t, False), (out_t, True)):
            if key not in tensors:
                tensors.append(key)
    reg = {key: REGS[k] for k, key in enumerate(tensors)}
    saved = [r for r in REGS[:len(tensors)] if r in CALLEE_SAVED]
    want = [("endbr64", "")] + [("push", r) for r in saved]
    want += [("mov", f"{r},QWORD PTR [rdi+{8 * k:#x}]") for k, r in enumerate(reg.values())]
    for in_t, out_t, src, dst, nbytes in copies:
        done = 0
        while done < nbytes:
            n = next(c for c in (32, 16, 8, 4, 2, 1) if nbytes - done >= c)
            data, size = DATA[n]
            op = "vmovdqu" if n >= 16 else "mov"
            want.append((op, f"{data},{size} PTR [{reg[(in_t, False)]}+{src + done:#x}]"))
            want.append((op, f"{size} PTR [{reg[(out_t, True)]}+{dst + done:#x}],{data}"))
            done += n
    want += [("add", f"{r},QWORD PTR [rsi+{8 * k:#x}]") for k, r in enumerate(reg.values())]
    want += [("dec", "rdx"), ("jne", "TOP"), ("vzeroupper", "")]
    want += [("pop", r) for r in reversed(saved)] + [("ret", "")]
    return want


def _programs():
    """Copy lists of 2 to 10 tensors, every move size from every register as load base and
    as store base, copies of 1 to 70 bytes, offsets from 0 to just under 2 GiB."""
    rng = random.Random(0)
    programs = []
    for n_tensors in range(2, 11):
        for _ in range(4 if n_tensors < 10 else 16):  # r15 is only the tenth
            n_in = rng.randint(1, n_tensors - 1)
            n_out = n_tensors - n_in
            # every tensor used, first uses in a random order
            pairs = [(i, rng.randrange(n_out)) for i in range(n_in)]
            pairs += [(rng.randrange(n_in), o) for o in range(n_out)]
            pairs += [(rng.randrange(n_in), rng.randrange(n_out)) for _ in range(12)]
            rng.shuffle(pairs)
            program = []
            for i, o in pairs:
                nbytes = rng.choice([1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 70])
                far = (1 << 31) - 1 - nbytes  # the largest offset a copy may reach
                src = rng.choice([0, 3, 4096, far, rng.randrange(far)])
                dst = rng.choice([0, 5, 65536, far, rng.randrange(far)])
                program.append((i, o, src, dst, nbytes))
            programs.append(program)
    return programs


@needs_machine_code
def test_every_emitted_instruction_disassembles_to_what_the_program_says(tmp_path):
    seen = set()
    for copies in _programs():
        code = _code(copies)
        listing = _disassemble(code, tmp_path)
        got = [(m, ops) for _, m, ops in listing]
        want = _expected(copies)
        top = 1 + sum(1 for m, _ in want if m == "push") + len({(c[0], False) for c in copies}
                                                              | {(c[1], True) for c in copies})
        want[want.index(("jne", "TOP"))] = ("jne", f"{listing[top][0]:#x}")
        assert got == want, next((k, g, w) for k, (g, w) in enumerate(zip(got, want)) if g != w)
        # every byte decoded: the last instruction, ret (one byte), ends the code
        assert listing[-1][0] == len(code) - 1 and "(bad)" not in str(listing)
        for m, ops in got[top:]:
            if m in ("mov", "vmovdqu") and "[rsi" not in ops:
                size = ops.split(" PTR")[0].split(",")[-1]
                base = re.search(r"\[(\w+)\+", ops).group(1)
                seen.add((size, base, ops.startswith(size)))  # a store starts with its size
    # the programs reach every move size from every register, as a load and as a store
    # (but rcx, always the first copy's input, and r8, its output)
    want = {(size, r, store) for _, size in DATA.values() for r in REGS for store in (False, True)
            if (r, store) not in (("rcx", True), ("r8", False))}
    assert seen == want, sorted(want - seen)


@needs_machine_code
def test_code_starts_with_endbr64_for_indirect_branch_tracking():
    for copies in _programs():
        assert _code(copies)[:4] == bytes.fromhex("f30f1efa")


@needs_machine_code
def test_programs_the_machine_code_cannot_hold_get_none():
    eleven = [(k, k, 0, 0, 4) for k in range(6)]  # 6 inputs + 6 outputs: 12 registers
    assert _code(eleven) == b""
    assert _code(eleven[:5]) != b""  # 10
    far = (1 << 31) - 4
    assert _code([(0, 0, far, 0, 4)]) == b""  # past 2 GiB
    assert _code([(0, 0, far - 1, 0, 4)]) != b""


# --- what ran, and why: torch.ops.kt_regroup._cpu_copy_program() ----------------------

OP = torch.ops.kt_regroup.permute_multi_embedding
BACKWARD_OP = torch.ops.kt_regroup.permute_multi_embedding_backward
INTO_OP = torch.ops.kt_regroup.permute_multi_embedding_into
REPORT = torch.ops.kt_regroup._cpu_copy_program
# Where machine code runs, AVX2 is on: the interpreter that runs instead is its AVX2 build.
INTERPRETER = "avx2 interpreter"


def _plan(widths, groups):
    """Plan tensors of inputs of the given key widths ({key: width} per input) and groups
    of keys, with the inputs' and outputs' widths."""
    from kt_regroup.plan import get_plan

    plan = get_plan([list(w) for w in widths], [list(w.values()) for w in widths], groups)
    return (*plan.tensors(), list(plan.out_lengths)), list(plan.in_lengths)


def _regroup(values, widths, groups):
    """The oracle: slices and torch.cat."""
    cols = {}
    for v, w in zip(values, widths):
        start = 0
        for key, n in w.items():
            cols[key] = v[:, start:start + n]
            start += n
    return [torch.cat([cols[k] for k in g], 1) for g in groups]


def _run_and_report(widths, groups, batch=3):
    args, in_lengths = _plan(widths, groups)
    gen = torch.Generator().manual_seed(len(groups))
    values = [torch.randn(batch, n, generator=gen) for n in in_lengths]
    got = OP(values, *args)
    assert len(got) == len(groups)
    assert all(torch.equal(a, b) for a, b in zip(got, _regroup(values, widths, groups)))
    return REPORT()


@needs_machine_code
def test_the_report_says_machine_code_ran_for_a_plan_it_holds():
    widths = [{"a": 4, "b": 8}, {"c": 16}]
    assert _run_and_report(widths, [["c", "a"], ["b"]]) == "machine code"


@needs_machine_code
def test_the_report_says_why_the_interpreter_ran():
    # 6 inputs and 6 outputs: 12 registers
    many = [{f"k{i}": 2} for i in range(6)]
    assert _run_and_report(many, [[f"k{i}"] for i in range(6)]) == (
        f"{INTERPRETER} (12 tensors: the machine code holds 10)")
    # one 4 MiB key: 131072 moves of 32 bytes, 18 bytes each
    wide = [{"w": 1 << 20}]
    report = _run_and_report(wide, [["w"]], batch=1)
    size = int(re.search(r"would take (\d+) bytes, more than 65536\)$", report).group(1))
    assert report.startswith(INTERPRETER) and size > (1 << 17) * 18, report
    # and back to machine code for the next plan that it holds
    assert _run_and_report([{"a": 4}], [["a"]]) == "machine code"


def _child(*parts: str, **env) -> subprocess.CompletedProcess:
    """A fresh Python process running the parts (each dedented) one after the other."""
    import os
    import sys
    import textwrap

    base = {k: v for k, v in os.environ.items() if not k.startswith("KT_REGROUP_")}
    code = "".join(textwrap.dedent(p) for p in parts)
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# Refuses mprotect(PROT_EXEC) with EACCES in every thread of the process, as SELinux's
# execmem denial does, through a seccomp filter (x86-64 syscall numbers).
REFUSE_EXEC = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
    LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JSET|K, RET|K
    insns = [(LD, 0, 0, 4), (JEQ, 0, 5, 0xC000003E),  # arch == x86-64
             (LD, 0, 0, 0), (JEQ, 0, 3, 10),  # nr == mprotect
             (LD, 0, 0, 32), (JSET, 0, 1, 4),  # prot & PROT_EXEC
             (RET, 0, 0, 0x00050000 | 13),  # SECCOMP_RET_ERRNO | EACCES
             (RET, 0, 0, 0x7FFF0000)]  # SECCOMP_RET_ALLOW
    array = (Insn * len(insns))(*[Insn(*i) for i in insns])
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, prog)
    assert libc.syscall(317, 1, 1, ctypes.byref(Prog(len(insns), array))) == 0
"""


@needs_machine_code
def test_where_executable_memory_is_refused_the_report_says_so_and_results_are_right():
    done = _child("""
        import torch, kt_regroup
        from kt_regroup.plan import get_plan
        op = torch.ops.kt_regroup
        plan = get_plan([["a", "b"], ["c", "d"]], [[3, 16], [8, 5]], [["d", "a", "c"], ["b", "a"]])
        args = (*plan.tensors(), list(plan.out_lengths))
        values = [torch.randn(7, n) for n in plan.in_lengths]
        want = [torch.cat([values[1][:, 8:], values[0][:, :3], values[1][:, :8]], 1),
                torch.cat([values[0][:, 3:], values[0][:, :3]], 1)]
        """, REFUSE_EXEC, """
        assert op._cpu_machine_code([0, 0, 0, 0, 4]).numel() == 0
        assert all(torch.equal(a, b) for a, b in zip(op.permute_multi_embedding(values, *args), want))
        print(op._cpu_copy_program())
        outs = [torch.empty_like(w) for w in want]
        op.permute_multi_embedding_into(values, *args[:3], outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, want))
        # the backward, whose copies run a copy program of their own ('a' is used twice)
        ins = op.permute_multi_embedding_backward(
            want, *args[:3], list(plan.in_lengths), 7, torch.float32)
        a = values[0][:, :3]
        assert torch.equal(ins[0], torch.cat([a + a, values[0][:, 3:]], 1)), ins
        assert torch.equal(ins[1], values[1]), ins
        print(op._cpu_copy_program())
    """)
    lines = done.stdout.split("\n")
    refused = f"{INTERPRETER} (executable memory refused: mprotect: Permission denied)"
    assert lines[:2] == [refused, refused], done.stdout


@needs_machine_code
def test_a_plan_too_large_for_machine_code_writes_none_of_its_code():
    # One 16 MiB key: 9.4 MB of moves if its code were written before the size limit
    # rejects it. The process's peak resident memory must not grow by that.
    done = _child("""
        import resource, torch, kt_regroup
        op = torch.ops.kt_regroup
        def plan(n):
            i32 = torch.int32
            return (torch.tensor([[0, 0, 0, 0, n, 0]], dtype=i32), torch.tensor([n], dtype=i32),
                    torch.tensor([n], dtype=i32))
        n = 16 << 20
        values = [torch.randint(0, 256, (1, n), dtype=torch.uint8)]
        outs = [torch.ones(1, n, dtype=torch.uint8)]
        small = [values[0][:, :64]]
        op.permute_multi_embedding_into(small, *plan(64), [torch.empty(1, 64, dtype=torch.uint8)])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        op.permute_multi_embedding_into(values, *plan(n), outs)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert torch.equal(outs[0], values[0])
        print(grew)
        print(op._cpu_machine_code([0, 0, 0, 0, n]).numel())
    """)
    grew_kib, code = map(int, done.stdout.split())
    assert code == 0
    assert grew_kib < 2048, f"peak RSS grew by {grew_kib} KiB"
