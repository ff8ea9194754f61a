// The CPU copy programs as machine code (x86-64 Linux with AVX2).
//
// Compiled per plan, a row of a copy program is straight-line code: per copy, one load and
// one store at fixed offsets from one register per tensor; then every register steps one
// row. The interpreter (cpu.cpp) reads each copy's offsets from its table and leaves a loop
// per run, which costs more than the copies themselves when they are 16 or 32 bytes.
// FBGEMM's CPU embedding kernels are generated the same way (with asmjit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace kt_regroup {

// Whether the AVX2 builds run (the interpreter's and the machine code): an x86-64 CPU with
// AVX2, and KT_REGROUP_AVX2 not 0. Read at load.
bool avx2_enabled();

// One copy of a row: `nbytes` from byte `src` of a row of input `in_t` to byte `dst` of the
// same row of output `out_t`.
struct RowCopy {
  int64_t in_t;
  int64_t out_t;
  int64_t src;
  int64_t dst;
  int64_t nbytes;
};

// What ran a copy program, or why the interpreter did (for _cpu_copy_program).
enum class CopyEngine : uint8_t {
  kNone,  // no copy program has run yet
  kMachineCode,
  // the interpreter, because:
  kNotBuilt,        // no machine code on this platform (x86-64 Linux only)
  kNoAvx2,          // the CPU has no AVX2
  kAvx2Off,         // KT_REGROUP_AVX2=0
  kJitOff,          // KT_REGROUP_JIT=0
  kTooManyTensors,  // detail: the program's tensors
  kFarOffsets,      // detail: the farthest byte of a row a copy reaches
  kTooLarge,        // detail: the bytes of code it would take
  kRefused,         // executable memory refused; detail: errno * 2 + (1 for mprotect, 0 for mmap)
  kNotKept,         // a program not kept with a plan (a pass of the fused cast) is not compiled
  // no program: rows past the cache are copied with streaming stores; detail: bytes
  kStreaming,
};
struct CopyEngineWhy {
  CopyEngine engine;
  int64_t detail = 0;
};

// A copy program's code. Its page is written, then made read-only and executable (never
// both writable and executable), and is unmapped with the object.
class MachineCode {
 public:
  MachineCode(const MachineCode&) = delete;
  MachineCode& operator=(const MachineCode&) = delete;
  ~MachineCode();

  // Row pointers and strides (bytes) of the program's tensors, by index; rows [b0, b1),
  // b1 > b0.
  void run(
      const char* const* in_base,
      const int64_t* in_stride,
      char* const* out_base,
      const int64_t* out_stride,
      int64_t b0,
      int64_t b1) const;

  // The code as it runs (what a disassembler reads).
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(code_); }
  size_t size() const { return size_; }

  // One register per tensor; 64 KiB of code at most.
  static constexpr size_t kMaxTensors = 10;
  static constexpr size_t kMaxBytes = 64 << 10;

 private:
  friend std::shared_ptr<const MachineCode> compile_machine_code(
      const std::vector<RowCopy>&, CopyEngineWhy&);
  using Fn = void (*)(char* const* row, const int64_t* stride, int64_t rows);
  MachineCode(void* code, size_t size, std::vector<std::pair<int64_t, bool>> tensors);

  void* code_;
  size_t size_;
  Fn fn_;
  std::vector<std::pair<int64_t, bool>> tensors_;  // per register: (index, is an output)
};

// The code of `copies` (run in that order, every row), or null and why not: no machine
// code on this platform or CPU, KT_REGROUP_JIT=0, more than kMaxTensors tensors, offsets
// past 2 GiB, more than kMaxBytes of code (known from the copies' sizes before any code is
// written), or no executable memory. The interpreter runs the program then.
std::shared_ptr<const MachineCode> compile_machine_code(
    const std::vector<RowCopy>& copies, CopyEngineWhy& why);

// Records what ran a copy program (the last call's answer to _cpu_copy_program).
void record_copy_engine(CopyEngineWhy why);

}  // namespace kt_regroup
