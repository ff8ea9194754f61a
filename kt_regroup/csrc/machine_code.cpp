// The CPU copy programs as machine code: see machine_code.h.

#include "machine_code.h"
#include "cpu_memory.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <sstream>
#include <string>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KT_X86 1
#endif
#if defined(KT_X86) && defined(__linux__)
#define KT_MACHINE_CODE 1
#endif

namespace kt_regroup {
namespace {

#if defined(KT_X86)
// KT_REGROUP_AVX2=0 runs the baseline builds on any CPU (the tests check both builds).
const bool kAvx2 = __builtin_cpu_supports("avx2") && env_flag("KT_REGROUP_AVX2", true);
#else
const bool kAvx2 = false;
#endif
#if defined(KT_MACHINE_CODE)
// KT_REGROUP_JIT=0 keeps the interpreter (read where machine code could run).
const bool kJit = kAvx2 && env_flag("KT_REGROUP_JIT", true);
#endif

// x86-64 encodings of the few instructions the code needs; memory operands are always
// [base + disp32].
struct Assembler {
  std::vector<uint8_t> code;

  void byte(int b) { code.push_back(static_cast<uint8_t>(b)); }
  void disp32(int64_t v) {
    for (int i = 0; i < 4; ++i) byte(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
  }
  void rex(bool w, int reg, int base) {
    const int r = 0x40 | (w ? 8 : 0) | (reg >> 3) << 2 | (base >> 3);
    if (r != 0x40) byte(r);
  }
  void mem(int reg, int base, int64_t disp) {  // ModRM, mod 10: [base + disp32]
    byte(0x80 | (reg & 7) << 3 | (base & 7));
    disp32(disp);
  }
  void endbr64() { byte(0xF3), byte(0x0F), byte(0x1E), byte(0xFA); }
  void push(int reg) { rex(false, 0, reg), byte(0x50 + (reg & 7)); }
  void pop(int reg) { rex(false, 0, reg), byte(0x58 + (reg & 7)); }
  void load_ptr(int reg, int base, int64_t disp) {  // mov reg, [base + disp]
    rex(true, reg, base), byte(0x8B), mem(reg, base, disp);
  }
  void add_ptr(int reg, int base, int64_t disp) {  // add reg, [base + disp]
    rex(true, reg, base), byte(0x03), mem(reg, base, disp);
  }

  // n (1, 2, 4, 8, 16 or 32) bytes from [src + s] to [dst + d]: through al/ax/eax/rax,
  // or xmm0/ymm0 (vmovdqu).
  void move(int n, int src, int64_t s, int dst, int64_t d) {
    for (const bool load : {true, false}) {
      const int base = load ? src : dst;
      if (n >= 16) {  // VEX.{128,256}.F3.0F 6F (load) / 7F (store)
        byte(0xC4), byte(base >= 8 ? 0xC1 : 0xE1), byte(n == 32 ? 0x7E : 0x7A);
        byte(load ? 0x6F : 0x7F);
      } else {
        if (n == 2) byte(0x66);
        rex(n == 8, 0, base);
        byte(n == 1 ? (load ? 0x8A : 0x88) : (load ? 0x8B : 0x89));
      }
      mem(0, base, load ? s : d);
    }
  }
};

// rcx, r8-r11, rbx, rbp, r13-r15: one row pointer per tensor (rdi, rsi and rdx hold the
// arguments, rax and ymm0 the data; rsp and r12 would need another byte per move).
constexpr int kRegs[] = {1, 8, 9, 10, 11, 3, 5, 13, 14, 15};
static_assert(std::size(kRegs) == MachineCode::kMaxTensors);

// What compile_machine_code gives every program here: kMachineCode, or why none.
CopyEngineWhy machine_code_setting() {
#if defined(KT_MACHINE_CODE)
  if (kJit) return {CopyEngine::kMachineCode};
  if (kAvx2) return {CopyEngine::kJitOff};
  return {__builtin_cpu_supports("avx2") ? CopyEngine::kAvx2Off : CopyEngine::kNoAvx2};
#else
  return {CopyEngine::kNotBuilt};
#endif
}

}  // namespace

bool avx2_enabled() {
  return kAvx2;
}

MachineCode::MachineCode(void* code, size_t size, std::vector<std::pair<int64_t, bool>> tensors)
    : code_(code), size_(size), fn_(reinterpret_cast<Fn>(code)), tensors_(std::move(tensors)) {}

MachineCode::~MachineCode() {
#if defined(KT_MACHINE_CODE)
  munmap(code_, size_);
#endif
}

void MachineCode::run(
    const char* const* in_base,
    const int64_t* in_stride,
    char* const* out_base,
    const int64_t* out_stride,
    int64_t b0,
    int64_t b1) const {
  char* row[kMaxTensors];
  int64_t stride[kMaxTensors];
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const auto [t, is_out] = tensors_[k];
    stride[k] = is_out ? out_stride[t] : in_stride[t];
    char* base = is_out ? out_base[t] : const_cast<char*>(in_base[t]);
    row[k] = base + b0 * stride[k];
  }
  fn_(row, stride, b1 - b0);
}

std::shared_ptr<const MachineCode> compile_machine_code(
    const std::vector<RowCopy>& copies, CopyEngineWhy& why) {
  why = machine_code_setting();
#if defined(KT_MACHINE_CODE)
  if (why.engine != CopyEngine::kMachineCode || copies.empty()) return nullptr;
  constexpr int kRowArg = 7, kStrideArg = 6;  // rdi, rsi; rdx counts the rows
  std::vector<std::pair<int64_t, bool>> tensors;
  auto reg_of = [&](int64_t t, bool is_out) {
    const std::pair<int64_t, bool> key{t, is_out};
    auto it = std::find(tensors.begin(), tensors.end(), key);
    if (it == tensors.end()) it = tensors.insert(tensors.end(), key);
    const size_t k = static_cast<size_t>(it - tensors.begin());
    return k < MachineCode::kMaxTensors ? kRegs[k] : -1;
  };
  int64_t far = 0;
  for (const RowCopy& c : copies) {
    reg_of(c.in_t, false), reg_of(c.out_t, true);
    far = std::max({far, c.src + c.nbytes, c.dst + c.nbytes});
  }
  if (tensors.size() > MachineCode::kMaxTensors) {
    why = {CopyEngine::kTooManyTensors, int64_t(tensors.size())};
    return nullptr;
  }
  if (far >= int64_t(1) << 31) {  // disp32
    why = {CopyEngine::kFarOffsets, far};
    return nullptr;
  }
  // The chunks of a copy: 32, 16, 8, 4, 2, then 1 bytes.
  auto chunks = [](int64_t nbytes, auto&& each) {
    for (int64_t done = 0; done < nbytes;) {
      const int64_t left = nbytes - done;
      const int n = left >= 32   ? 32
                    : left >= 16 ? 16
                    : left >= 8  ? 8
                    : left >= 4  ? 4
                    : left >= 2  ? 2
                                 : 1;
      if (n == 32) {
        each(32, done, left / 32);  // all of the copy's 32-byte moves at once
        done += left / 32 * 32;
      } else {
        each(n, done, int64_t(1));
        done += n;
      }
    }
  };
  // The bytes of one move by size and by whether its load and store bases are r8 or up
  // (a REX or VEX.B bit), from the encoder itself.
  auto move_bytes = [](int n, int src, int dst) {
    Assembler t;
    t.move(n, src >= 8 ? 8 : 1, 0, dst >= 8 ? 8 : 1, 0);
    return int64_t(t.code.size());
  };
  int64_t sizes[33][2][2] = {};
  for (int n : {1, 2, 4, 8, 16, 32}) {
    for (int s : {0, 1}) {
      for (int d : {0, 1}) sizes[n][s][d] = move_bytes(n, s ? 8 : 1, d ? 8 : 1);
    }
  }

  Assembler a;
  std::vector<int> saved;
  auto prologue = [&](Assembler& a) {
    a.endbr64();  // an indirect call's target, where indirect-branch tracking is enforced
    for (size_t k = 0; k < tensors.size(); ++k) {
      const int r = kRegs[k];
      if (r == 3 || r == 5 || r >= 12) saved.push_back(r), a.push(r);  // callee-saved
    }
    for (size_t k = 0; k < tensors.size(); ++k) a.load_ptr(kRegs[k], kRowArg, 8 * int64_t(k));
  };
  auto epilogue = [&](Assembler& a, int64_t top) {
    for (size_t k = 0; k < tensors.size(); ++k) a.add_ptr(kRegs[k], kStrideArg, 8 * int64_t(k));
    a.byte(0x48), a.byte(0xFF), a.byte(0xCA);  // dec rdx
    a.byte(0x0F), a.byte(0x85);                // jnz top
    a.disp32(top - int64_t(a.code.size() + 4));
    a.byte(0xC5), a.byte(0xF8), a.byte(0x77);  // vzeroupper
    for (auto r = saved.rbegin(); r != saved.rend(); ++r) a.pop(*r);
    a.byte(0xC3);  // ret
  };
  prologue(a);
  const size_t top = a.code.size();
  // The size of the code, known before any copy is written.
  Assembler tail;
  epilogue(tail, 0);
  int64_t total = int64_t(top + tail.code.size());
  for (const RowCopy& c : copies) {
    const int src = reg_of(c.in_t, false) >= 8, dst = reg_of(c.out_t, true) >= 8;
    chunks(c.nbytes, [&](int n, int64_t, int64_t count) { total += count * sizes[n][src][dst]; });
  }
  if (total > int64_t(MachineCode::kMaxBytes)) {
    why = {CopyEngine::kTooLarge, total};
    return nullptr;
  }
  a.code.reserve(total);
  for (const RowCopy& c : copies) {
    const int src = reg_of(c.in_t, false), dst = reg_of(c.out_t, true);
    chunks(c.nbytes, [&](int n, int64_t done, int64_t count) {
      for (int64_t k = 0; k < count; ++k, done += n)
        a.move(n, src, c.src + done, dst, c.dst + done);
    });
  }
  epilogue(a, int64_t(top));
  TORCH_INTERNAL_ASSERT(
      int64_t(a.code.size()) == total, "machine code of ", a.code.size(), " bytes, ", total,
      " expected");

  const size_t size = a.code.size();
  void* mem = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    why = {CopyEngine::kRefused, int64_t(errno) * 2};
    return nullptr;
  }
  std::memcpy(mem, a.code.data(), size);
  if (mprotect(mem, size, PROT_READ | PROT_EXEC) != 0) {
    why = {CopyEngine::kRefused, int64_t(errno) * 2 + 1};
    munmap(mem, size);
    return nullptr;
  }
  return std::shared_ptr<const MachineCode>(new MachineCode(mem, size, std::move(tensors)));
#else
  (void)copies;
  return nullptr;
#endif
}

namespace {
// The last recorded CopyEngineWhy: engine | detail << 8 (0: none yet).
std::atomic<uint64_t> last_engine{0};
}  // namespace

void record_copy_engine(CopyEngineWhy why) {
  const uint64_t packed = static_cast<uint64_t>(why.engine) | static_cast<uint64_t>(why.detail)
                                                                  << 8;
  // A load first: calls that run the same program leave the cache line shared.
  if (last_engine.load(std::memory_order_relaxed) != packed) {
    last_engine.store(packed, std::memory_order_relaxed);
  }
}

namespace {

// A CopyEngineWhy in words.
std::string describe(CopyEngineWhy why) {
  std::ostringstream s;
  switch (why.engine) {
    case CopyEngine::kNone: {
      const CopyEngineWhy setting = machine_code_setting();
      return "none has run yet: " + (setting.engine == CopyEngine::kMachineCode
                                         ? "machine code where a plan allows it"
                                         : describe(setting));
    }
    case CopyEngine::kMachineCode:
      return "machine code";
    case CopyEngine::kStreaming:
      return "streaming stores (" + std::to_string(why.detail) +
             " bytes written, past the cache: no copy program)";
    case CopyEngine::kNotBuilt:
      s << "no machine code on this platform (x86-64 Linux only)";
      break;
    case CopyEngine::kNoAvx2:
      s << "the CPU has no AVX2";
      break;
    case CopyEngine::kAvx2Off:
      s << "KT_REGROUP_AVX2=0";
      break;
    case CopyEngine::kJitOff:
      s << "KT_REGROUP_JIT=0";
      break;
    case CopyEngine::kTooManyTensors:
      s << why.detail << " tensors: the machine code holds " << MachineCode::kMaxTensors;
      break;
    case CopyEngine::kFarOffsets:
      s << "a copy reaches byte " << why.detail
        << " of a row: the machine code's offsets stop at 2 GiB";
      break;
    case CopyEngine::kTooLarge:
      s << "its machine code would take " << why.detail << " bytes, more than "
        << MachineCode::kMaxBytes;
      break;
    case CopyEngine::kRefused:
      s << "executable memory refused: " << (why.detail & 1 ? "mprotect" : "mmap") << ": "
        << std::strerror(static_cast<int>(why.detail / 2));
      break;
    case CopyEngine::kNotKept:
      s << "a pass of the fused cast over some inputs: its program is not kept with a plan";
      break;
  }
  return (avx2_enabled() ? "avx2 interpreter (" : "baseline interpreter (") + s.str() + ")";
}

// What ran the last copy program, and why.
std::string cpu_copy_program() {
  const uint64_t packed = last_engine.load(std::memory_order_relaxed);
  return describe({static_cast<CopyEngine>(packed & 0xFF), static_cast<int64_t>(packed >> 8)});
}

// The code compile_machine_code gives for copies [in_t, out_t, src, dst, nbytes] * n, as
// bytes (empty where it gives none): for the tests, which disassemble it.
at::Tensor cpu_machine_code(c10::IntArrayRef flat) {
  TORCH_CHECK_VALUE(
      flat.size() % 5 == 0,
      "kt_regroup._cpu_machine_code: copies must be [in_t, out_t, src, "
      "dst, nbytes] * n, got ",
      flat.size(), " values");
  std::vector<RowCopy> copies;
  for (size_t k = 0; k < flat.size(); k += 5) {
    for (size_t i = 0; i < 5; ++i) {
      TORCH_CHECK_VALUE(
          flat[k + i] >= 0 && (i >= 2 || flat[k + i] < 1024) && (i != 4 || flat[k + i] > 0),
          "kt_regroup._cpu_machine_code: copy ", k / 5, " has ", flat[k + i], " at ", i);
    }
    copies.push_back(RowCopy{flat[k], flat[k + 1], flat[k + 2], flat[k + 3], flat[k + 4]});
  }
  CopyEngineWhy why;
  const std::shared_ptr<const MachineCode> code = compile_machine_code(copies, why);
  at::Tensor out = at::empty({code ? int64_t(code->size()) : 0}, at::kByte);
  if (code) std::memcpy(out.mutable_data_ptr(), code->bytes(), code->size());
  return out;
}

}  // namespace
}  // namespace kt_regroup

TORCH_LIBRARY_FRAGMENT(kt_regroup, m) {
  m.def("_cpu_copy_program() -> str", &kt_regroup::cpu_copy_program);
  m.def("_cpu_machine_code(int[] copies) -> Tensor", &kt_regroup::cpu_machine_code);
}
