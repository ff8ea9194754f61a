// Native CPU kernels of torch.ops.kt_regroup.permute_multi_embedding{,_to,_into,_backward}.
//
// Forward is a row-major byte copy: for each batch row (rows split across threads),
// copy every coalesced segment, run as a copy program compiled per plan. The backward
// runs the same program the other way for what is a copy (columns of an input gradient
// that one upstream gradient of the same dtype, read with unit column stride, feeds);
// the rest goes through a block loop that writes each element once, right after the
// copies of the same rows: a column block with several contributions (duplicated keys)
// is summed in row order, one read with other strides is copied (or filled, for a
// broadcast upstream gradient), and only the columns no key covers are zeroed. Upstream
// gradients are read with their own strides, stride 0 included, never materialised.
// Arguments are checked (ops.cpp) before any data is touched.

#include "cpu_memory.h"
#include "kt_regroup.h"
#include "machine_code.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <functional>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace kt_regroup {
namespace {

// Above this many bytes copied per call, segments are reordered to read inputs in order.
constexpr int64_t kReorderBytes = 1024 * 1024;

// A tensor whose rows can be read with memcpy: unit column stride, no lazy conj/neg.
at::Tensor rows_readable(const at::Tensor& t) {
  at::Tensor r = resolve_lazy(t);
  if (r.size(1) > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}

// memcpy for the mid-sized segments of a regroup (hundreds of bytes to a few KiB).
// glibc switches to `rep movsb` for such sizes, which is slow on some CPUs (AMD Zen)
// for unlucky source/destination offsets; plain vector moves stream at full speed.
inline void copy_segment(char* dst, const char* src, int64_t n) {
  // Fixed-size memcpy calls compile to inline vector moves.
  for (; n >= 64; n -= 64, dst += 64, src += 64) std::memcpy(dst, src, 64);
  for (; n >= 16; n -= 16, dst += 16, src += 16) std::memcpy(dst, src, 16);
  for (; n >= 4; n -= 4, dst += 4, src += 4) std::memcpy(dst, src, 4);
  for (; n > 0; --n) *dst++ = *src++;
}

#if defined(__SSE2__)
// copy_segment with non-temporal (streaming) stores: the destination's cache lines are
// not read first (no read-for-ownership) and do not evict the rows being read. Only whole
// 64-byte lines stream; a segment's partial first and last lines take normal stores, so
// no line gets both kinds (slower than either). A thread ends its streaming with
// stream_fence().
inline void stream_segment(char* dst, const char* src, int64_t n) {
  const int64_t head = std::min<int64_t>(n, (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63);
  copy_segment(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
  copy_segment(dst, src, n);
}
inline void stream_fence() {
  _mm_sfence();
}
// std::fill_n with streaming stores of whole lines (element sizes dividing 16 bytes).
template <typename T>
void stream_fill(T* d, int64_t n, T value) {
  static_assert(16 % sizeof(T) == 0);
  int64_t head = ((64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63) / int64_t(sizeof(T));
  if (reinterpret_cast<uintptr_t>(d) % sizeof(T) != 0 || head > n) head = n;
  std::fill_n(d, head, value);
  d += head, n -= head;
  alignas(16) T pattern[16 / sizeof(T)];
  std::fill_n(pattern, 16 / sizeof(T), value);
  const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(pattern));
  constexpr int64_t per = 64 / sizeof(T);
  for (; n >= per; n -= per, d += per) {
    for (int q = 0; q < 4; ++q) _mm_stream_si128(reinterpret_cast<__m128i*>(d) + q, v);
  }
  std::fill_n(d, n, value);
}
#else
template <typename T>
void stream_fill(T* d, int64_t n, T value) {
  std::fill_n(d, n, value);
}
inline void stream_segment(char* dst, const char* src, int64_t n) {
  copy_segment(dst, src, n);
}
inline void stream_fence() {}
#endif

// The size of the last-level cache one core reaches (Linux sysfs; 0 where unknown). Not
// sysconf(_SC_LEVEL3_CACHE_SIZE): where the L3 is split between core complexes, that is
// the sum of all of them.
int64_t last_level_cache_bytes() {
  int top = 0;
  int64_t bytes = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    int64_t size = 0;
    std::string unit;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;  // "32768K"
    const int64_t scale = unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : unit == "G" ? 1 << 30 : 1;
    if (level > top) top = level, bytes = size * scale;
  }
  return bytes;
}

// Copies of at least kStreamCopyBytes on average that write at least this many bytes
// stream their stores (stream_segment): a quarter of the last-level cache (the rows read
// and written no longer fit in it), between 4 and 32 MiB; 32 MiB where the cache size is
// unknown. Below it the rows stay cached and normal stores are as fast (docs/cpu_kernel.md).
int64_t stream_bytes() {
  static const int64_t bytes = [] {
    const int64_t llc = last_level_cache_bytes();
    return llc > 0 ? std::clamp<int64_t>(llc / 4, int64_t(4) << 20, int64_t(32) << 20)
                   : int64_t(32) << 20;
  }();
  return bytes;
}

// Shorter copies are mostly partial lines, which take normal stores anyway: they take
// the streaming path (its plain copy loop, each input read in order) from 32 MiB only,
// where it beats the copy program (docs/cpu_kernel.md).
constexpr int64_t kStreamCopyBytes = 256;
constexpr int64_t kStreamAnyBytes = int64_t(32) << 20;

// Whether a copy writing `bytes` in copies of `copy_bytes` on average streams its stores.
// Into memory whose pages exist (the _into op's outs, blocks the output cache reused)
// only: a page the fault has just zeroed is still cached, so streaming into it gains nothing.
bool use_streaming(int64_t bytes, int64_t copy_bytes, bool warm) {
  return warm &&
         (bytes >= kStreamAnyBytes || (bytes >= stream_bytes() && copy_bytes >= kStreamCopyBytes));
}

// Outputs [batch, n] for each n, zero-filled unless `tiled` (every column written);
// `warm` is set to whether all of them reuse faulted-in pages.
std::vector<at::Tensor> new_outputs(
    int64_t batch,
    c10::IntArrayRef widths,
    const c10::TensorOptions& options,
    bool tiled,
    bool& warm) {
  std::vector<at::Tensor> outs;
  outs.reserve(widths.size());
  warm = true;
  for (int64_t n : widths) {
    bool w = false;
    outs.push_back(tiled ? empty_cpu({batch, n}, options, &w) : zeros_cpu({batch, n}, options, &w));
    warm = warm && w;
  }
  return outs;
}

int64_t grain_rows(int64_t bytes_per_row) {
  return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, bytes_per_row));
}

bool writes_disjoint(const std::vector<Segment>& segments) {
  std::vector<const Segment*> order;
  order.reserve(segments.size());
  for (const Segment& s : segments) order.push_back(&s);
  std::sort(order.begin(), order.end(), [](const Segment* a, const Segment* b) {
    return a->out_t != b->out_t ? a->out_t < b->out_t : a->out_off < b->out_off;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const Segment* a = order[k - 1];
    const Segment* b = order[k];
    if (a->out_t == b->out_t && a->out_off + a->length > b->out_off) return false;
  }
  return true;
}

// The order to run the segments in, per batch row.
std::vector<const Segment*> copy_order(const std::vector<Segment>& segments, int64_t bytes) {
  std::vector<const Segment*> order;
  order.reserve(segments.size());
  for (const Segment& s : segments) order.push_back(&s);
  // Only worth it when the rows do not fit in cache anyway.
  if (bytes > kReorderBytes && writes_disjoint(segments)) {
    // Order no longer matters: read each input row once, front to back, which keeps
    // the hardware prefetcher on one read stream (the output rows stay sequential).
    std::stable_sort(order.begin(), order.end(), [](const Segment* a, const Segment* b) {
      return a->in_t != b->in_t ? a->in_t < b->in_t : a->in_off < b->in_off;
    });
  }
  return order;
}

// The forward with an element-wise cast fused into the copy (src_t -> dst_t).
template <typename src_t, typename dst_t>
void permute_convert_into(
    at::TensorList pooled_embs, const std::vector<Segment>& segments, at::TensorList outs) {
  const int64_t batch = pooled_embs[0].size(0);
  if (batch == 0 || segments.empty()) return;
  PerTensor<at::Tensor> inputs(pooled_embs.begin(), pooled_embs.end());
  for (at::Tensor& t : inputs) t = rows_readable(t);
  struct Convert {
    const src_t* src;
    int64_t src_stride;
    dst_t* dst;
    int64_t dst_stride;
    int64_t numel;
  };
  int64_t bytes_per_row = 0;
  for (const Segment& s : segments) bytes_per_row += s.length * int64_t(sizeof(src_t));
  std::vector<Convert> converts;
  converts.reserve(segments.size());
  for (const Segment* sp : copy_order(segments, batch * bytes_per_row)) {
    const Segment& s = *sp;
    const at::Tensor& in = inputs[s.in_t];
    const at::Tensor& out = outs[s.out_t];
    converts.push_back(Convert{
        static_cast<const src_t*>(in.const_data_ptr()) + s.in_off, in.stride(0),
        static_cast<dst_t*>(out.data_ptr()) + s.out_off, out.stride(0), s.length});
  }
  at::parallel_for(0, batch, grain_rows(bytes_per_row), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (const Convert& c : converts) {
        const src_t* src = c.src + b * c.src_stride;
        dst_t* dst = c.dst + b * c.dst_stride;
        for (int64_t k = 0; k < c.numel; ++k) dst[k] = static_cast<dst_t>(src[k]);
      }
    }
  });
}

// ---- the forward copy program -----------------------------------------------------------
//
// Serving layouts have dozens of narrow keys (8 to 32 columns): a row is dozens of
// copies of 16 to 128 bytes, where a general copy loop spends more on its own control
// (a length, a loop per size class) than on the bytes. The forward therefore runs a
// program compiled per plan and element size: per batch row, runs of copies that read
// one input, write one output and share one byte width; a run of a common width copies
// with a fixed-size move (straight vector loads and stores), the rest with copy_segment.
// A run whose copies write back to back reads only their sources.
// On CPUs with AVX2 the program runs as a second compilation of itself that moves 32
// bytes at a time (Avx2Runs).

// Byte offsets of one copy inside its input and output rows, and its size.
struct CopyOp {
  int64_t src;
  int64_t dst;
  int64_t nbytes;
};
struct CopyRun {
  int64_t in_t;
  int64_t out_t;
  int64_t width;  // bytes of every op in the run, one of kFixedWidths; 0: each op's own
  int64_t first;  // its ops: ops[first, first + count)
  int64_t count;
  bool contiguous;  // each op writes right after the one before (only .src is read)
  size_t slot = 0;  // which function runs it (run_slot)
};
constexpr int64_t kFixedWidths[] = {2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512};
constexpr size_t kWidthSlots = std::size(kFixedWidths) + 1;  // and one for other widths

// The index of a copy of `nbytes` in kFixedWidths; std::size(kFixedWidths) for other sizes.
size_t width_index(int64_t nbytes) {
  size_t i = 0;
  while (i < std::size(kFixedWidths) && kFixedWidths[i] != nbytes) ++i;
  return i;
}

// The slot of a run: its width's index (the last for other widths), plus kWidthSlots for
// a contiguous run.
size_t run_slot(const CopyRun& run) {
  return width_index(run.width) + (run.contiguous ? kWidthSlots : 0);
}

// Narrow copies go kRowsPerPass rows at a time: per copy, the loads of every row, then
// the stores (one row at a time, each store waits on its load). A program runs in passes
// when at least half its copies are in runs of fixed widths up to kPassWidth bytes; in a
// pass, other runs still go one row at a time. Wider runs gain nothing from passes
// (docs/cpu_kernel.md).
constexpr int kRowsPerPass = 4;
constexpr int64_t kPassWidth = 64;

struct ForwardProgram {
  std::vector<CopyRun> runs;
  std::vector<CopyOp> ops;
  int64_t bytes_per_row = 0;
  int64_t es = 0;
  bool in_passes = false;  // rows go kRowsPerPass at a time (output order only)
  // The program as machine code (programs kept with their plans; machine_code.h), or null,
  // and why.
  std::shared_ptr<const MachineCode> code;
  CopyEngineWhy engine{CopyEngine::kNotKept};
};

// Rows of at least this many bytes are copied in input order (`reorder`): past the L1
// cache, reading each input row front to back keeps the prefetcher on one stream. Shorter
// rows are copied in output order, where runs write front to back (see
// CopyRun::contiguous). Measurements: docs/cpu_kernel.md.
constexpr int64_t kReorderRowBytes = 32 * 1024;

// `reorder`: read each input row front to back when the rows are long (the writes are
// disjoint, so the order of the copies is free); otherwise the segments' order is kept
// (later writes win).
ForwardProgram compile_forward(const std::vector<Segment>& segments, int64_t es, bool reorder) {
  ForwardProgram p;
  p.es = es;
  auto width_of = [&](const Segment& s) {
    const size_t i = width_index(s.length * es);
    return i < std::size(kFixedWidths) ? kFixedWidths[i] : int64_t(0);
  };
  std::vector<const Segment*> order;
  order.reserve(segments.size());
  for (const Segment& s : segments) {
    order.push_back(&s);
    p.bytes_per_row += s.length * es;
  }
  if (reorder && p.bytes_per_row >= kReorderRowBytes && writes_disjoint(segments)) {
    // Grouped by input, output and width (long runs of one kind of move), each run
    // reading its input front to back.
    std::stable_sort(order.begin(), order.end(), [&](const Segment* a, const Segment* b) {
      if (a->in_t != b->in_t) return a->in_t < b->in_t;
      if (a->out_t != b->out_t) return a->out_t < b->out_t;
      const int64_t wa = width_of(*a), wb = width_of(*b);
      return wa != wb ? wa < wb : a->in_off < b->in_off;
    });
  }
  p.ops.reserve(order.size());
  for (const Segment* s : order) {
    const int64_t w = width_of(*s);
    const CopyOp op{s->in_off * es, s->out_off * es, s->length * es};
    CopyRun* run = p.runs.empty() ? nullptr : &p.runs.back();
    if (run && (run->in_t != s->in_t || run->out_t != s->out_t || run->width != w)) run = nullptr;
    if (run) {
      const bool next = w != 0 && op.dst == p.ops.back().dst + w;
      if (run->count == 1) {
        run->contiguous = next;
      } else if (run->contiguous && !next) {
        run = nullptr;  // a new run from here
      }
    }
    if (!run) {
      p.runs.push_back(CopyRun{s->in_t, s->out_t, w, int64_t(p.ops.size()), 0, w != 0});
      run = &p.runs.back();
    }
    ++run->count;
    p.ops.push_back(op);
  }
  size_t narrow = 0;
  for (const CopyRun& run : p.runs) {
    if (run.width != 0 && run.width <= kPassWidth) narrow += run.count;
  }
  p.in_passes = p.bytes_per_row < kReorderRowBytes && 2 * narrow >= p.ops.size();
  for (CopyRun& run : p.runs) run.slot = run_slot(run);
  return p;
}

#if defined(__GNUC__) || defined(__clang__)
#define KT_INLINE inline __attribute__((always_inline))
#define KT_VECTORS 1
#else
#define KT_INLINE inline
#endif

// Moves of N bytes, one chunk at a time: the widest chunk dividing N.
template <int64_t N>
constexpr int64_t chunk_bytes() {
  for (int64_t c : {32, 16, 8, 4, 2}) {
    if (N % c == 0) return c;
  }
  return 1;
}
template <int64_t C>
struct ChunkMove {  // 8 bytes or fewer: an integer register
  using reg = std::conditional_t<C == 8, int64_t, std::conditional_t<C == 4, int32_t, int16_t>>;
  static KT_INLINE reg load(const char* s) {
    reg v;
    std::memcpy(&v, s, C);
    return v;
  }
  static KT_INLINE void store(char* d, reg v) { std::memcpy(d, &v, C); }
};
#if defined(KT_VECTORS)
// B bytes in one vector register, read and written through an unaligned, aliasing type
// (not memcpy into a local, which GCC keeps in memory for a 32-byte vector in a function
// not compiled for AVX). Everything taking or returning one is always inlined, so no call
// passes it: GCC's -Wpsabi note on 32-byte vectors does not apply.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
template <int64_t B>
struct VectorMove {
  typedef long long reg __attribute__((vector_size(B)));
  typedef long long mem __attribute__((vector_size(B), may_alias, aligned(1)));
  static KT_INLINE reg load(const char* s) { return *reinterpret_cast<const mem*>(s); }
  static KT_INLINE void store(char* d, reg v) { *reinterpret_cast<mem*>(d) = v; }
};
template <>
struct ChunkMove<16> : VectorMove<16> {};
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KT_X86_AVX2 1
// Moves of 32 bytes: used only by the build of the program compiled for AVX2
// (Avx2Runs), where they are one register.
template <>
struct ChunkMove<32> : VectorMove<32> {};
#endif

// The widest chunk a build of the program moves at once: 32 bytes in the AVX2 one, 16
// (SSE2, NEON) or 8 bytes elsewhere.
#if defined(KT_VECTORS)
constexpr int64_t kBaseChunk = 16;
#else
constexpr int64_t kBaseChunk = 8;
#endif

// N bytes at offset `so` of R source rows to offset `dof` of R destination rows: R loads,
// then R stores, one chunk of the width at a time. The loads are written first: the
// compiler may not move a load above a store through char pointers.
template <int64_t N, int R, int64_t W>
KT_INLINE void move_rows(char* const* d, int64_t dof, const char* const* s, int64_t so) {
  constexpr int64_t C = std::min(chunk_bytes<N>(), W);
  using M = ChunkMove<C>;
  for (int64_t i = 0; i < N; i += C) {
    typename M::reg v[R];
    for (int r = 0; r < R; ++r) v[r] = M::load(s[r] + so + i);
    for (int r = 0; r < R; ++r) M::store(d[r] + dof + i, v[r]);
  }
}

// `count` copies of N bytes in R rows: fixed-size moves the compiler emits inline. A
// contiguous run reads only each op's source offset and writes front to back.
template <int64_t N, bool Contiguous, int R, int64_t W>
KT_INLINE void copy_fixed(
    char* dst, int64_t ds, const char* src, int64_t ss, const CopyOp* op, int64_t count) {
  char* d[R];
  const char* s[R];
  for (int r = 0; r < R; ++r) d[r] = dst + r * ds, s[r] = src + r * ss;
  if constexpr (Contiguous) {
    int64_t dof = op[0].dst;
    for (int64_t k = 0; k < count; ++k, dof += N) move_rows<N, R, W>(d, dof, s, op[k].src);
  } else {
    for (int64_t k = 0; k < count; ++k) move_rows<N, R, W>(d, op[k].dst, s, op[k].src);
  }
}

// One run over R rows (dst and src: its output and input at the first row, rows ds and ss
// bytes apart); N = 0 for a run of other widths. In a pass (R > 1), runs wider than
// kPassWidth still go one row at a time.
template <int64_t N, bool Contiguous, int R, int64_t W>
KT_INLINE void run_rows(
    const CopyRun& run, char* dst, int64_t ds, const char* src, int64_t ss, const CopyOp* ops) {
  const CopyOp* op = ops + run.first;
  if constexpr (N == 0) {
    for (int r = 0; r < R; ++r) {
      for (int64_t k = 0; k < run.count; ++k) {
        copy_segment(dst + r * ds + op[k].dst, src + r * ss + op[k].src, op[k].nbytes);
      }
    }
  } else if constexpr (R > 1 && N > kPassWidth) {
    for (int r = 0; r < R; ++r) {
      copy_fixed<N, Contiguous, 1, W>(dst + r * ds, ds, src + r * ss, ss, op, run.count);
    }
  } else {
    copy_fixed<N, Contiguous, R, W>(dst, ds, src, ss, op, run.count);
  }
}

// Each kind of run is a small function of its own, which the program calls through a
// table (CopyRun::slot): faster than one function that tests each run's width against
// every common width (docs/cpu_kernel.md).
using RunFn = void (*)(const CopyRun&, char*, int64_t, const char*, int64_t, const CopyOp*);

// The two compilations of the run functions: baseline moves of up to kBaseChunk bytes, and
// 32-byte moves for CPUs with AVX2 (the library is built for baseline x86-64, whose widest
// moves are 16 bytes: a copy of 32 or 64 bytes is then one or two loads and stores
// instead of two or four).
struct BaseRuns {
  template <int64_t N, bool Contiguous, int R>
  static void run(
      const CopyRun& r, char* dst, int64_t ds, const char* src, int64_t ss, const CopyOp* ops) {
    run_rows<N, Contiguous, R, kBaseChunk>(r, dst, ds, src, ss, ops);
  }
};
#if defined(KT_X86_AVX2)
struct Avx2Runs {
  template <int64_t N, bool Contiguous, int R>
  __attribute__((target("avx2"))) static void run(
      const CopyRun& r, char* dst, int64_t ds, const char* src, int64_t ss, const CopyOp* ops) {
    run_rows<N, Contiguous, R, 32>(r, dst, ds, src, ss, ops);
  }
};
#endif

// The run functions of one compilation for R rows, by slot.
template <class Runs, int R, size_t... I>
constexpr std::array<RunFn, 2 * kWidthSlots> run_table(std::index_sequence<I...>) {
  return {
      &Runs::template run<kFixedWidths[I], false, R>..., &Runs::template run<0, false, R>,
      &Runs::template run<kFixedWidths[I], true, R>..., &Runs::template run<0, true, R>};
}

// The program over rows [b0, b1).
struct ProgramRows {
  const CopyRun* runs;
  size_t n_runs;
  const CopyOp* ops;
  const char* const* in_base;
  const int64_t* in_stride;
  char* const* out_base;
  const int64_t* out_stride;
  bool in_passes;  // ForwardProgram::in_passes
};

inline void program_pass(const ProgramRows& p, int64_t b, const RunFn* fns) {
  for (size_t r = 0; r < p.n_runs; ++r) {
    const CopyRun& run = p.runs[r];
    const int64_t ds = p.out_stride[run.out_t], ss = p.in_stride[run.in_t];
    fns[run.slot](run, p.out_base[run.out_t] + b * ds, ds, p.in_base[run.in_t] + b * ss, ss, p.ops);
  }
}

template <class Runs>
void program_rows(const ProgramRows& p, int64_t b0, int64_t b1) {
  constexpr auto widths = std::make_index_sequence<std::size(kFixedWidths)>();
  static constexpr std::array<RunFn, 2 * kWidthSlots> one = run_table<Runs, 1>(widths);
  static constexpr std::array<RunFn, 2 * kWidthSlots> pass = run_table<Runs, kRowsPerPass>(widths);
  int64_t b = b0;
  if (p.in_passes) {
    for (; b + kRowsPerPass <= b1; b += kRowsPerPass) program_pass(p, b, pass.data());
  }
  for (; b < b1; ++b) program_pass(p, b, one.data());
}

void run_program_rows(const ProgramRows& p, int64_t b0, int64_t b1) {
#if defined(KT_X86_AVX2)
  if (avx2_enabled()) return program_rows<Avx2Runs>(p, b0, b1);
#endif
  program_rows<BaseRuns>(p, b0, b1);
}

// The program of a plan's segments, kept with the plan: compiled to machine code too.
ForwardProgram compile_kept(const std::vector<Segment>& segments, int64_t es) {
  ForwardProgram p = compile_forward(segments, es, /*reorder=*/true);
  std::vector<RowCopy> copies;
  copies.reserve(p.ops.size());
  for (const CopyRun& run : p.runs) {
    for (int64_t k = run.first; k < run.first + run.count; ++k) {
      const CopyOp& op = p.ops[k];
      copies.push_back(RowCopy{run.in_t, run.out_t, op.src, op.dst, op.nbytes});
    }
  }
  p.code = compile_machine_code(copies, p.engine);
  return p;
}

// copy(b0, b1), then after(b0, b1) when given, in steps of about kGrainBytes of rows.
template <typename Copy>
void in_steps(
    int64_t b0,
    int64_t b1,
    int64_t bytes_per_row,
    const std::function<void(int64_t, int64_t)>& after,
    const Copy& copy) {
  if (!after) return copy(b0, b1);
  const int64_t step = grain_rows(bytes_per_row);
  for (int64_t s = b0; s < b1; s += step) {
    const int64_t e = std::min(b1, s + step);
    copy(s, e);
    after(s, e);
  }
}

// Row 0 and the row stride (bytes) of every input and output of a copy program.
struct ProgramTensors {
  PerTensor<const char*> in_base;
  PerTensor<int64_t> in_stride;
  PerTensor<char*> out_base;
  PerTensor<int64_t> out_stride;
};

// The program's copies on rows [0, batch). `warm`: the outputs' pages are faulted in (see
// use_streaming). `after(b0, b1)`, when given, runs on rows [b0, b1) right after the copies
// of those rows, a few hundred KiB of rows at a time, while they are in cache (the
// backward's sums).
void run_program(
    int64_t batch,
    const ProgramTensors& t,
    const std::vector<Segment>& segments,
    const ForwardProgram& program,
    bool warm,
    const std::function<void(int64_t, int64_t)>& after = {}) {
  if (batch == 0 || segments.empty()) return;
  const int64_t es = program.es;
  const int64_t bytes_per_row = program.bytes_per_row;

  if (use_streaming(
          batch * bytes_per_row, bytes_per_row / static_cast<int64_t>(segments.size()), warm)) {
    record_copy_engine({CopyEngine::kStreaming, batch * bytes_per_row});
    struct Copy {
      const char* src;
      int64_t src_stride;
      char* dst;
      int64_t dst_stride;
      int64_t nbytes;
    };
    std::vector<Copy> copies;
    copies.reserve(segments.size());
    for (const Segment* sp : copy_order(segments, batch * bytes_per_row)) {
      const Segment& s = *sp;
      copies.push_back(Copy{
          t.in_base[s.in_t] + s.in_off * es, t.in_stride[s.in_t],
          t.out_base[s.out_t] + s.out_off * es, t.out_stride[s.out_t], s.length * es});
    }
    at::parallel_for(0, batch, grain_rows(bytes_per_row), [&](int64_t b0, int64_t b1) {
      in_steps(b0, b1, bytes_per_row, after, [&](int64_t s0, int64_t s1) {
        for (int64_t b = s0; b < s1; ++b) {
          for (const Copy& c : copies) {
            stream_segment(c.dst + b * c.dst_stride, c.src + b * c.src_stride, c.nbytes);
          }
        }
      });
      stream_fence();
    });
    return;
  }

  record_copy_engine(program.engine);
  const ProgramRows rows{program.runs.data(), program.runs.size(), program.ops.data(),
                         t.in_base.data(),    t.in_stride.data(),  t.out_base.data(),
                         t.out_stride.data(), program.in_passes};
  at::parallel_for(0, batch, grain_rows(bytes_per_row), [&](int64_t b0, int64_t b1) {
    in_steps(b0, b1, bytes_per_row, after, [&](int64_t s0, int64_t s1) {
      if (program.code && s1 > s0) {
        return program.code->run(
            t.in_base.data(), t.in_stride.data(), t.out_base.data(), t.out_stride.data(), s0, s1);
      }
      run_program_rows(rows, s0, s1);
    });
  });
}

// run_program on tensors. The inputs have the outputs' dtype (the fused cast sends other
// inputs to permute_convert_into).
void run_forward(
    at::TensorList pooled_embs,
    const std::vector<Segment>& segments,
    const ForwardProgram& program,
    at::TensorList outs,
    bool warm,
    const std::function<void(int64_t, int64_t)>& after = {}) {
  const int64_t batch = pooled_embs[0].size(0);
  if (batch == 0 || segments.empty()) return;
  const int64_t es = program.es;
  PerTensor<at::Tensor> inputs(pooled_embs.begin(), pooled_embs.end());
  ProgramTensors t;
  for (at::Tensor& in : inputs) {
    in = rows_readable(in);
    t.in_base.push_back(static_cast<const char*>(in.const_data_ptr()));
    t.in_stride.push_back(in.stride(0) * es);
  }
  for (const at::Tensor& out : outs) {
    t.out_base.push_back(static_cast<char*>(out.data_ptr()));
    t.out_stride.push_back(out.stride(0) * es);
  }
  run_program(batch, t, segments, program, warm, after);
}

void permute_forward_into(
    at::TensorList pooled_embs,
    const std::vector<Segment>& segments,
    at::TensorList outs,
    bool warm) {
  if (pooled_embs[0].size(0) == 0 || segments.empty()) return;
  const int64_t es = outs[segments[0].out_t].element_size();
  run_forward(pooled_embs, segments, compile_forward(segments, es, /*reorder=*/true), outs, warm);
}

// The same for all of a checked plan's segments, with the program the plan keeps.
void permute_plan_into(
    at::TensorList pooled_embs, const CheckedPlan& plan, at::TensorList outs, bool warm) {
  const std::vector<Segment>& segments = plan.segments;
  if (pooled_embs[0].size(0) == 0 || segments.empty()) return;
  const int64_t es = outs[segments[0].out_t].element_size();
  const int slot = es == 1 ? 0 : es == 2 ? 1 : es == 4 ? 2 : es == 8 ? 3 : 4;
  std::shared_ptr<const void>& compiled = plan.compiled[slot];
  if (!compiled || static_cast<const ForwardProgram*>(compiled.get())->es != es) {
    compiled = std::make_shared<const ForwardProgram>(compile_kept(segments, es));
  }
  run_forward(
      pooled_embs, segments, *static_cast<const ForwardProgram*>(compiled.get()), outs, warm);
}

std::vector<at::Tensor> permute_multi_embedding_cpu(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  const std::shared_ptr<const CheckedPlan> plan = check(
      {"permute_multi_embedding", Kind::kForward, pointers(pooled_embs)},
      {permutes, in_shapes, out_shapes, out_lengths});
  const at::Tensor& first = pooled_embs[0];
  const int64_t batch = first.size(0);
  // Every column written exactly once: skip the zero fill.
  bool warm = false;
  std::vector<at::Tensor> outs =
      new_outputs(batch, out_lengths, first.options(), plan->tiled, warm);
  permute_plan_into(pooled_embs, *plan, outs, warm);
  return outs;
}

std::vector<at::Tensor> permute_multi_embedding_to_cpu(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype) {
  // With a dtype, inputs may differ in dtype (fp16/bf16 embeddings next to fp32 dense
  // features): each is cast in the copy.
  const std::shared_ptr<const CheckedPlan> plan = check(
      {"permute_multi_embedding_to", dtype ? Kind::kCast : Kind::kForward, pointers(pooled_embs)},
      {permutes, in_shapes, out_shapes, out_lengths});
  const std::vector<Segment>& segments = plan->segments;
  const at::Tensor& first = pooled_embs[0];
  const c10::ScalarType out_dtype = dtype.value_or(first.scalar_type());
  const int64_t batch = first.size(0);
  bool warm = false;
  std::vector<at::Tensor> outs =
      new_outputs(batch, out_lengths, first.options().dtype(out_dtype), plan->tiled, warm);
  // One pass per input dtype, over the segments that read inputs of that dtype.
  std::vector<std::pair<c10::ScalarType, std::vector<Segment>>> passes;
  for (const Segment& s : segments) {
    const c10::ScalarType in_dtype = pooled_embs[s.in_t].scalar_type();
    auto it = std::find_if(
        passes.begin(), passes.end(), [&](const auto& p) { return p.first == in_dtype; });
    if (it == passes.end()) it = passes.insert(passes.end(), {in_dtype, {}});
    it->second.push_back(s);
  }
  for (const auto& [in_dtype, segs] : passes) {
    if (in_dtype == out_dtype && passes.size() == 1) {
      permute_plan_into(pooled_embs, *plan, outs, warm);
    } else if (in_dtype == out_dtype) {
      permute_forward_into(pooled_embs, segs, outs, warm);
    } else if (is_float(in_dtype) && is_float(out_dtype)) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in_dtype, "kt_regroup_to", [&] {
        using src_t = scalar_t;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "kt_regroup_to", [&] {
          permute_convert_into<src_t, scalar_t>(pooled_embs, segs, outs);
        });
      });
    } else {  // integer / complex casts: ATen's copy_ casts
      for (const Segment& s : segs) {
        outs[s.out_t]
            .narrow(1, s.out_off, s.length)
            .copy_(pooled_embs[s.in_t].narrow(1, s.in_off, s.length));
      }
    }
  }
  return outs;
}

// Inference entry point writing into caller-owned outputs (no allocation, no autograd).
// `outs[j]` must be [batch, out_shapes[j]] with unit column stride and must not overlap
// the inputs.
void permute_multi_embedding_into_cpu(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  const std::shared_ptr<const CheckedPlan> plan = check(
      {"permute_multi_embedding_into", Kind::kInto, pointers(pooled_embs), 0, outs},
      {permutes, in_shapes, out_shapes});
  if (!plan->tiled) {
    for (const at::Tensor& t : outs) t.zero_();
  }
  permute_plan_into(pooled_embs, *plan, outs, /*warm=*/true);
}

// ---- backward -------------------------------------------------------------------------

// One column block of an input-gradient row and where its values come from.
struct GradBlock {
  int64_t dst_off;  // element offset in the input-gradient row
  int64_t numel;
  int64_t first;  // index of its first source in `sources`
  int64_t count;  // 0: zeros; 1: copy; more: sum in row order
  int64_t out_i;  // which input gradient
  bool unit;      // every source has unit column stride (or one column)
};
// Column `col` of upstream gradient `grad`.
struct GradSource {
  int64_t grad;
  int64_t col;
};
// Element (b, c) of an upstream gradient is at base + b * row_stride + c * col_stride
// (elements). Strides come straight from the tensor: 0 for broadcast (expanded) rows or
// columns, anything for transposed or sliced ones; nothing is materialised.
struct GradView {
  const void* base = nullptr;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};
using GradDsts = PerTensor<std::pair<char*, int64_t>>;

template <typename scalar_t>
using acc_type_t = std::conditional_t<
    std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>,
    float,
    scalar_t>;

// The type a gradient of `dst_t` accumulates in, and the type each addition of a
// `src_t` value is done in (as `acc += src` in ATen: the wider of the two, rounded back).
template <typename dst_t, typename src_t>
using add_type_t = std::conditional_t<
    std::is_same_v<src_t, double> || std::is_same_v<acc_type_t<dst_t>, double>,
    double,
    acc_type_t<dst_t>>;

// One gradient value of `src_t` as a `dst_t` gradient: through the accumulation type, as
// the reference rounds it (no rounding at all for the same type: the bits are kept).
template <typename dst_t, typename src_t>
inline dst_t grad_convert(src_t v) {
  if constexpr (std::is_same_v<src_t, dst_t>) {
    return v;
  } else {
    return static_cast<dst_t>(
        static_cast<acc_type_t<dst_t>>(static_cast<add_type_t<dst_t, src_t>>(v)));
  }
}

// The first element of source `g` in row b.
template <typename src_t>
inline const src_t* source_row(const GradSource& g, const GradView* views, int64_t b) {
  const GradView& v = views[g.grad];
  return static_cast<const src_t*>(v.base) + b * v.row_stride + g.col * v.col_stride;
}

// d[c] = sum over sources k, in row order, of s_k[c]; each d[c] written once, float16 /
// bfloat16 accumulated in float32 and rounded once.
template <typename dst_t, typename src_t, bool kUnit>
void sum_sources(
    dst_t* d,
    const GradSource* src,
    const GradView* views,
    int64_t count,
    int64_t numel,
    int64_t b) {
  using acc_t = acc_type_t<dst_t>;
  using add_t = add_type_t<dst_t, src_t>;
  constexpr int64_t kChunk = 512;  // fits L1 next to the rows it reads
  acc_t acc[kChunk];
  for (int64_t c0 = 0; c0 < numel; c0 += kChunk) {
    const int64_t n = std::min(kChunk, numel - c0);
    for (int64_t k = 0; k < count; ++k) {
      const int64_t cs = kUnit ? 1 : views[src[k].grad].col_stride;
      const src_t* s = source_row<src_t>(src[k], views, b) + c0 * cs;
      if (k == 0) {
        for (int64_t c = 0; c < n; ++c) acc[c] = static_cast<acc_t>(static_cast<add_t>(s[c * cs]));
      } else {
        for (int64_t c = 0; c < n; ++c) {
          acc[c] = static_cast<acc_t>(static_cast<add_t>(acc[c]) + static_cast<add_t>(s[c * cs]));
        }
      }
    }
    for (int64_t c = 0; c < n; ++c) d[c0 + c] = static_cast<dst_t>(acc[c]);
  }
}

// The blocks of rows [b0, b1): gradients of `src_t` into input gradients of `dst_t`; the
// same type is a byte copy where a block has one source, another (the fused cast's
// backward) converts each value.
template <typename dst_t, typename src_t>
void backward_row_range(
    int64_t b0,
    int64_t b1,
    const std::vector<GradBlock>& blocks,
    const std::vector<GradSource>& sources,
    const GradView* views,
    const GradDsts& dsts,  // input gradient: base, row stride
    bool stream) {
  constexpr bool kSame = std::is_same_v<dst_t, src_t>;
  constexpr int64_t es = sizeof(dst_t);
  for (int64_t b = b0; b < b1; ++b) {
    for (const GradBlock& g : blocks) {
      dst_t* d =
          reinterpret_cast<dst_t*>(dsts[g.out_i].first + b * dsts[g.out_i].second) + g.dst_off;
      if (g.count == 0) {  // columns of keys no group uses
        std::memset(d, 0, g.numel * es);
        continue;
      }
      const GradSource* src = sources.data() + g.first;
      if (g.count == 1) {
        const src_t* s = source_row<src_t>(*src, views, b);
        const int64_t cs = views[src->grad].col_stride;
        if (g.unit && kSame) {
          char* dc = reinterpret_cast<char*>(d);
          const char* sc = reinterpret_cast<const char*>(s);
          if (stream) {
            stream_segment(dc, sc, g.numel * es);
          } else {
            copy_segment(dc, sc, g.numel * es);
          }
        } else if (g.unit) {
          for (int64_t c = 0; c < g.numel; ++c) d[c] = grad_convert<dst_t>(s[c]);
        } else if (cs == 0) {  // a broadcast row: out.sum() and friends
          if (stream) {
            stream_fill(d, g.numel, grad_convert<dst_t>(*s));
          } else {
            std::fill_n(d, g.numel, grad_convert<dst_t>(*s));
          }
        } else {
          for (int64_t c = 0; c < g.numel; ++c) d[c] = grad_convert<dst_t>(s[c * cs]);
        }
        continue;
      }
      if (g.unit) {
        sum_sources<dst_t, src_t, true>(d, src, views, g.count, g.numel, b);
      } else {
        sum_sources<dst_t, src_t, false>(d, src, views, g.count, g.numel, b);
      }
    }
  }
  if (stream) stream_fence();
}

// The backward of a checked plan for one kind of call (dtypes, which upstream gradients
// are given and which have unit column stride), built once and kept with the plan.
// Per input: its columns cut at every segment boundary, each piece's sources in row
// order, neighbouring pieces merged where their sources continue contiguously. Blocks of
// one unit-stride source of the same dtype are copies, run by the forward's copy program;
// the rest (sums of duplicated keys, zeros, strided, broadcast and cast sources) by the
// block loop, right after the copies of their rows while those are in cache.
struct BackwardPlan {
  c10::ScalarType dtype, grad_dtype;
  PerTensor<int8_t> kind;  // per upstream gradient: 0 None, 1 unit column stride, 2 other
  std::vector<GradBlock> blocks;
  std::vector<GradSource> sources;
  int64_t block_bytes = 0;      // per row, of `blocks`
  std::vector<Segment> copies;  // in_t: an upstream gradient, out_t: an input gradient
  std::shared_ptr<const ForwardProgram> program;
};
struct BackwardPlans {
  static constexpr size_t kEntries = 4;
  std::vector<BackwardPlan> entries;
};

BackwardPlan plan_backward(
    const std::vector<Segment>& segments,
    c10::IntArrayRef in_widths,
    c10::ScalarType dtype,
    c10::ScalarType grad_dtype,
    PerTensor<int8_t> kind) {
  BackwardPlan p;
  p.dtype = dtype;
  p.grad_dtype = grad_dtype;
  p.kind = std::move(kind);
  const int64_t n_in = static_cast<int64_t>(in_widths.size());
  const int64_t es = c10::elementSize(dtype);
  std::vector<std::vector<const Segment*>> by_input(n_in);
  for (const Segment& s : segments) {
    if (p.kind[s.out_t] != 0) by_input[s.in_t].push_back(&s);
  }
  struct Piece {
    int64_t out_t;
    int64_t out_off;
  };
  std::vector<GradBlock> blocks;
  std::vector<GradSource> sources;
  for (int64_t i = 0; i < n_in; ++i) {
    const int64_t width = in_widths[i];
    if (width == 0) continue;
    const auto& segs = by_input[i];
    std::vector<int64_t> cuts{0, width};
    for (const Segment* s : segs) {
      cuts.push_back(s->in_off);
      cuts.push_back(s->in_off + s->length);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    const size_t n_pieces = cuts.size() - 1;
    std::vector<std::vector<Piece>> pieces(n_pieces);
    for (const Segment* s : segs) {
      size_t k = std::lower_bound(cuts.begin(), cuts.end(), s->in_off) - cuts.begin();
      for (; k < n_pieces && cuts[k] < s->in_off + s->length; ++k) {
        pieces[k].push_back(Piece{s->out_t, s->out_off + (cuts[k] - s->in_off)});
      }
    }
    size_t k = 0;
    while (k < n_pieces) {
      size_t end = k + 1;
      while (end < n_pieces && pieces[end].size() == pieces[k].size()) {
        const auto& prev = pieces[end - 1];
        const auto& cur = pieces[end];
        const int64_t prev_len = cuts[end] - cuts[end - 1];
        bool continues = true;
        for (size_t j = 0; j < cur.size() && continues; ++j) {
          continues = cur[j].out_t == prev[j].out_t && cur[j].out_off == prev[j].out_off + prev_len;
        }
        if (!continues) break;
        ++end;
      }
      GradBlock g;
      g.dst_off = cuts[k];
      g.numel = cuts[end] - cuts[k];
      g.first = static_cast<int64_t>(sources.size());
      g.count = static_cast<int64_t>(pieces[k].size());
      g.out_i = i;
      g.unit = true;
      for (const Piece& q : pieces[k]) {
        g.unit = g.unit && (p.kind[q.out_t] == 1 || g.numel == 1);
        sources.push_back(GradSource{q.out_t, q.out_off});
      }
      blocks.push_back(g);
      k = end;
    }
  }
  for (const GradBlock& g : blocks) {
    const GradSource& src = sources[g.first];
    if (dtype == grad_dtype && g.count == 1 && g.unit && p.kind[src.grad] == 1) {
      p.copies.push_back(Segment{src.grad, g.out_i, src.col, g.dst_off, g.numel});
      continue;
    }
    GradBlock r = g;
    r.first = static_cast<int64_t>(p.sources.size());
    p.sources.insert(
        p.sources.end(), sources.begin() + g.first, sources.begin() + g.first + g.count);
    p.blocks.push_back(r);
    p.block_bytes += g.numel * es;
  }
  if (!p.copies.empty()) {
    p.program = std::make_shared<const ForwardProgram>(compile_kept(p.copies, es));
  }
  return p;
}

// The plan's BackwardPlan for this call, built on first use.
const BackwardPlan& backward_plan(
    const CheckedPlan& plan,
    const PerTensor<at::Tensor>& grads,  // undefined: None
    c10::IntArrayRef in_widths,
    c10::ScalarType dtype,
    c10::ScalarType grad_dtype) {
  PerTensor<int8_t> kind(grads.size(), 0);
  for (size_t j = 0; j < grads.size(); ++j) {
    if (grads[j].defined()) kind[j] = grads[j].size(1) <= 1 || grads[j].stride(1) == 1 ? 1 : 2;
  }
  if (!plan.backward) plan.backward = std::make_shared<BackwardPlans>();
  auto& entries = static_cast<BackwardPlans*>(plan.backward.get())->entries;
  for (const BackwardPlan& e : entries) {
    if (e.dtype == dtype && e.grad_dtype == grad_dtype && e.kind == kind) return e;
  }
  if (entries.size() == BackwardPlans::kEntries) entries.erase(entries.begin());
  entries.push_back(plan_backward(plan.segments, in_widths, dtype, grad_dtype, std::move(kind)));
  return entries.back();
}

// The block loop of `p` over rows [0, batch), on every thread.
template <typename dst_t, typename src_t>
void backward_rows(
    int64_t batch, const BackwardPlan& p, const GradView* views, const GradDsts& dsts, bool warm) {
  // Past the caches: streaming stores for copies and fills (sums keep normal stores).
  const bool stream = use_streaming(
      batch * p.block_bytes, p.block_bytes / std::max<int64_t>(1, p.blocks.size()), warm);
  at::parallel_for(0, batch, grain_rows(p.block_bytes), [&](int64_t b0, int64_t b1) {
    backward_row_range<dst_t, src_t>(b0, b1, p.blocks, p.sources, views, dsts, stream);
  });
}

std::vector<at::Tensor> permute_multi_embedding_backward_cpu(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    int64_t batch_size,
    c10::ScalarType dtype) {
  HeldTensors held;
  const Call call{
      "permute_multi_embedding_backward", Kind::kBackward, grad_pointers(grad_outputs, held),
      batch_size};
  const std::shared_ptr<const CheckedPlan> plan =
      check(call, {permutes, in_shapes, out_shapes, in_lengths});
  const TensorPtrs& grads = call.tensors;
  const c10::Device device = gradients_device(grads, permutes);
  // The gradients' dtype (check: one for all), the dtype's when there are none.
  c10::ScalarType grad_dtype = dtype;
  for (const at::Tensor* g : grads) {
    if (g) grad_dtype = g->scalar_type();
  }
  // The same dtype (float or integer), or a cast between float dtypes: the fused cast's
  // backward (upstream gradients in the output dtype, input gradients in the input's).
  const bool fast = grad_dtype == dtype
                        ? is_float(dtype) || c10::isIntegralType(dtype, /*includeBool=*/false)
                        : is_float(dtype) && is_float(grad_dtype);
  if (!fast) {
    return backward_by_segments(grads, plan->segments, in_lengths, batch_size, dtype, device);
  }
  bool warm = false;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(device);
  std::vector<at::Tensor> out = new_outputs(batch_size, in_lengths, options, /*tiled=*/true, warm);
  if (batch_size == 0) return out;

  // Gradients are read in place with their own strides (only lazy conj/neg resolved). A
  // broadcast scalar (both strides 0: the gradient of out.sum()) is read as one row of
  // its value, repeated (row stride 0), which the copy program reads.
  PerTensor<at::Tensor> readable(grads.size());
  for (size_t j = 0; j < grads.size(); ++j) {
    if (!grads[j]) continue;
    readable[j] = resolve_lazy(*grads[j]);
    const at::Tensor& g = readable[j];
    if (g.size(1) > 1 && g.stride(0) == 0 && g.stride(1) == 0) {
      at::Tensor row = at::empty({1, g.size(1)}, g.options());
      const int64_t es = g.element_size();
      const char* value = static_cast<const char*>(g.const_data_ptr());
      char* d = static_cast<char*>(row.data_ptr());
      for (int64_t c = 0; c < g.size(1); ++c) std::memcpy(d + c * es, value, es);
      readable[j] = row.expand(g.sizes());
    }
  }
  const BackwardPlan& p = backward_plan(*plan, readable, in_lengths, dtype, grad_dtype);
  const int64_t es = c10::elementSize(dtype);
  PerTensor<GradView> views(readable.size());
  ProgramTensors t;
  for (size_t j = 0; j < readable.size(); ++j) {
    const at::Tensor& g = readable[j];
    if (g.defined()) views[j] = GradView{g.const_data_ptr(), g.stride(0), g.stride(1)};
    t.in_base.push_back(static_cast<const char*>(views[j].base));
    t.in_stride.push_back(views[j].row_stride * es);
  }
  GradDsts dsts;
  for (const at::Tensor& o : out) {
    dsts.emplace_back(static_cast<char*>(o.data_ptr()), o.stride(0) * es);
    t.out_base.push_back(dsts.back().first);
    t.out_stride.push_back(dsts.back().second);
  }
  if (grad_dtype == dtype) {
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "kt_regroup_backward_cpu", [&] {
      if (!p.program)
        return backward_rows<scalar_t, scalar_t>(batch_size, p, views.data(), dsts, warm);
      std::function<void(int64_t, int64_t)> after;
      if (!p.blocks.empty()) {
        after = [&](int64_t b0, int64_t b1) {
          backward_row_range<scalar_t, scalar_t>(
              b0, b1, p.blocks, p.sources, views.data(), dsts, /*stream=*/false);
        };
      }
      run_program(batch_size, t, p.copies, *p.program, warm, after);
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "kt_regroup_backward_cpu", [&] {
          using dst_t = scalar_t;
          AT_DISPATCH_FLOATING_TYPES_AND2(
              at::kHalf, at::kBFloat16, grad_dtype, "kt_regroup_backward_cpu",
              [&] { backward_rows<dst_t, scalar_t>(batch_size, p, views.data(), dsts, warm); });
        });
  }
  return out;
}

}  // namespace
}  // namespace kt_regroup

TORCH_LIBRARY_IMPL(kt_regroup, CPU, m) {
  m.impl("permute_multi_embedding", TORCH_FN(kt_regroup::permute_multi_embedding_cpu));
  m.impl(
      "permute_multi_embedding_backward",
      TORCH_FN(kt_regroup::permute_multi_embedding_backward_cpu));
  m.impl("permute_multi_embedding_to", TORCH_FN(kt_regroup::permute_multi_embedding_to_cpu));
  m.impl("permute_multi_embedding_into", TORCH_FN(kt_regroup::permute_multi_embedding_into_cpu));
}
