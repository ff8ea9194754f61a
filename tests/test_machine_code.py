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
