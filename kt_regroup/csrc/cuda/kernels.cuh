// The device code of permute.cu (the CUDA kernels of
// torch.ops.kt_regroup.permute_multi_embedding{,_to,_into,_backward} and of the
// variable-batch permute_multi_embedding_vbe{,_backward}), the planning of their launches
// and the choice of kernel per dtype: nothing here calls the CUDA runtime, so
// tests/cuda_emulation.cpp runs the same code on the CPU. Included by both only.
//
// Design (the one home of these notes)
// ------
// *What they compute.* Exactly what tests/reference.py (the test oracle) computes, bit
// for bit, in one launch per call (per chunk of kMaxTensors tensors a side), whatever
// the number of rows; batch 0 launches nothing.
//
// *Plan on the device, never read on the host.* The rows of `permutes`
// ([in_tensor, out_tensor, in_offset, out_offset, length, next]) are read by the kernel;
// output sizes come from out_lengths / in_lengths, widths from the tensors' shapes; no
// .item(), no data-dependent size, no host sync: a training step that uses them can be
// captured in a CUDA graph. Where the plan is on the CPU it is checked in full first
// (check, no sync) and copied to the device; on the device only the checks that read no
// data run (check decides by where the plan is), as for permute_multi_embedding_into,
// whose outs are checked without data too.
//
// *Tensors as kernel arguments.* The pointers, strides, widths and dtypes of up to
// kMaxTensors tensors a side travel by value (`Tensors<N>`, baked into a CUDA graph):
// nothing is copied to the device per call, and every output is an allocation of its
// own. (One flat buffer sliced into the outputs was rejected: a custom op's outputs may
// not share storage, one kept group would pin the whole buffer, and
// permute_multi_embedding_into writes into caller-owned tensors anyway.) Beyond
// kMaxTensors the launch is repeated per chunk; rows of other chunks exit at once. A
// backward launch reads every gradient output (at most kMaxReads; more take the portable
// path). The variable-batch ops, with a thousand inputs as a rule, read theirs from a
// table on the device instead (below).
//
// *Grid.* 1-D: the first `zero_blocks` blocks fill the columns no row writes; the others
// are one block per (permute row, tile of batch rows), the row index varying fastest, so
// neighbouring blocks touch neighbouring columns of the same rows. A copy block moves its
// row's segment for its batch rows (about kTileBytes), kUnroll loads in flight per
// thread, in 16-byte vectors where the segment, its row strides and its pointers are
// 16-byte aligned; a contiguous segment that is not has each row copied as a head and a
// tail element by element and aligned 16-byte stores between them, their bytes read as
// aligned 16-byte words and shifted into place (copy_shifted); other segments element by
// element; int64 indexing throughout.
//
// *Columns no row writes* (gaps in an output, gradients of unused keys) are exact zeros,
// written once: a zero tile is a tile of columns (the written tensors side by side) and
// a range of batch rows; its block marks in shared memory the columns some row writes
// (scanning the plan; it is small and cached) and stores zeros in the others. The host
// does not read the plan, so it cannot tell which tiles hold gaps: there is one zero
// block per 32 copy blocks at most, each taking a run of tiles that share their columns
// (one scan per run's column tile), so that where the plan leaves no gap (as a rule) few
// blocks are idle and the plan is scanned about once per column tile. Copy blocks and
// zero blocks write disjoint columns, so one launch does both; nothing is zero-filled and
// then overwritten.
//
// *Duplicates* (the backward) are found in the plan, as the CPU kernel finds them:
// column 5 (torchrec's `next` chain) is never read, so a hand-made plan, or one whose
// chains differ, gives the CPU kernel's bits. A block of row r scans the plan (kThreads
// rows at a time) for the rows that write any of r's input-gradient columns: those an
// earlier row writes are that row's; on the others r's block sums the gradient blocks of
// r and of every later row writing them, in plan order, in float32 for float16/bfloat16
// (float64 where either side is float64, PyTorch's promotion); a column one gradient
// block of the same dtype writes keeps its bits (-0.0 too), copied as the forward copies
// (copy_shifted where contiguous and misaligned). Each input-gradient element is stored
// once. No atomics, no read-modify-write of global memory. Rows of other keys
// cost the scan only; more than kMaxLinks overlapping rows make every element walk the
// plan (slow, same bits).
//
// *Bad rows* never make an access leave its tensor: writes are clipped to the written
// tensor, reads outside the read tensor give 0, and a tensor index outside the list
// makes the row a no-op (its columns are zero-filled). What a bad plan computes is then
// defined but not meaningful: overlapping output segments of the forward race.
//
// *Variable batch* (permute_multi_embedding_vbe: out[j][b, cols] =
// pooled_embs[i][indices[i][b], cols], an input without an index read at row b). A
// thousand inputs do not fit in kernel parameters, so their tensors (pointers, strides,
// widths, rows, index pointers, block ranges: int64 fields, VbeIn / VbeOut / VbeGrad /
// VbeIndex) are a table on the device, built on the host and copied there once per call
// from pinned memory without a sync (read through ld_plan, as the plan). The forward is
// the byte copy above in one launch whatever the number of inputs: one block per
// (permute row, tile of batch rows), which reads its tile's input rows (indices[i][b])
// once into shared memory, and zero blocks as above, at most one per 32 copy blocks, each
// taking every zero_blocks-th tile of columns (where the plan leaves no gap they write
// nothing). The backward sums every sample's gradient into its row without atomics, in
// four launches whatever the number of inputs: vbe_keys_kernel gives each sample of an
// indexed input (slot k * batch + b of the k-th one) the key of its row among the indexed
// inputs' rows side by side; one stable sort of the keys (ATen) lists each row's samples
// in sample order; a search of each key's first slot (ATen) bounds them; then
// vbe_backward_kernel, one block per (input gradient, tile of its rows, tile of its
// columns), sized by the bytes it reads and writes, so none is idle. A block lists the
// plan rows adding to its columns (vbe_find_sums, as find_sums) and writes each element
// of its tile once: the sum over the row's samples in sample order, each sample's
// gradient blocks in plan order, in float32 for float16/bfloat16 (the CPU kernel's order,
// so its bits; a row without an index is its own sample, and one gradient block keeps its
// bits, in 16-byte vectors where aligned); zeros for rows no sample reads and columns no
// row adds to. The input gradients are views of one flat buffer (what the op returns). A
// row's sum is one thread's loop: rows read by many samples are slow, the price of the
// CPU's bits. Indices are checked on the device: an index outside its input stops the
// kernel with a device-side assert (as index_select's), after printing the CPU kernel's
// message (input, sample, value); the forward checks the indices of inputs some row
// reads, the backward every index (the CPU kernel checks every index). Reading them on
// the host would wait for the device; indices are on the data's device (the op checks
// it), so there is no host copy to check. The checks that read the plan run in full where
// it is on the CPU, as above. Other dtypes of the backward, or more than kMaxReads
// gradients (they are kernel parameters), take the portable path (index_add_).
//
// *Dtypes, and what is compiled.* The forward (and _into) is a byte copy, one kernel per
// element size (1, 2, 4, 8, 16 bytes), for any dtype. The fused cast of
// permute_multi_embedding_to converts float32/float64/float16/bfloat16 inside the copy
// exactly as torch's .to() rounds (c10's conversions): one kernel per output dtype, the
// input dtype read per tensor at run time; other casts go through .to() of the inputs
// first. The backward takes float32/float64/float16/bfloat16 gradients: one kernel per
// (input-gradient dtype, compute type), the gradients' dtype read at run time (7 kernels,
// not 16); other dtypes take the portable path. The variable-batch forward: one kernel per
// element size (5), its backward's keys one per key dtype (int32, int64 past 2^31 - 1
// rows: 2), its sums one per float dtype (4). 27 kernels in all.
//
// *Compiled and exported graphs.* torch.compile, torch.export and AOTInductor call the
// op, as FBGEMM's: the kernels run from the dispatcher, in eager, in a compiled graph,
// in TorchScript and in a C++ predictor alike.

#pragma once

#include "../kt_regroup.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

// An index outside its input (the variable-batch ops): a device-side assert, as
// index_select's, after printing the CPU kernel's message. The emulation records it.
#ifndef KT_REGROUP_INDEX_ASSERT
#define KT_REGROUP_INDEX_ASSERT(cond, fmt, ...) CUDA_KERNEL_ASSERT_PRINTF(cond, fmt, __VA_ARGS__)
#endif

namespace kt_regroup {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent loads in flight per thread
constexpr int kMaxTensors =
    32;  // tensors per side of a forward launch, and written by a backward one
constexpr int kMaxReads = 64;  // gradient outputs one backward launch reads (all of them)
constexpr int64_t kTileBytes = 32 * 1024;  // bytes a copy block moves (about)
constexpr int kZeroCols = 2048;            // columns per zero tile of the VBE forward
constexpr int kDenseZeroCols = 8192;       // columns per zero tile of the dense ops
constexpr int64_t kMaxZeroTiles = 512;     // per launch (more where batch rows need them)

// Element dtypes of the fused cast.
enum DtypeCode : int8_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kOther = 4 };

DtypeCode dtype_code(c10::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kF32;
    case at::kDouble:
      return kF64;
    case at::kHalf:
      return kF16;
    case at::kBFloat16:
      return kBF16;
    default:
      return kOther;
  }
}

// A dtype the fused cast and the backward take.
bool is_float(c10::ScalarType t) {
  return dtype_code(t) != kOther;
}

// The kernels' global memory accesses: data through ld/st (kSite names the call site),
// plan rows through ld_plan; tile_begins / tile_step mark a loop over a tile and each of
// its steps (a warp's lanes in step). Plain accesses on the device; the emulation
// (tests/cuda_emulation.cpp) traps misaligned 16-byte ones and its cost model records
// each access.
#ifndef KT_REGROUP_MEMORY_HOOKS
template <int kSite, typename T>
__device__ __forceinline__ T ld(const T* p) {
  return *p;
}
template <int kSite, typename T>
__device__ __forceinline__ void st(T* p, const T& v) {
  *p = v;
}
template <typename T>
__device__ __forceinline__ T ld_plan(const T* p) {
  return *p;
}
__device__ __forceinline__ void tile_begins() {}
__device__ __forceinline__ void tile_step() {}
#endif

// Up to N tensors of one side, by value. Strides and widths in elements.
template <int N>
struct Tensors {
  const char* ptr[N];
  int64_t row_stride[N];
  int64_t col_stride[N];
  int64_t width[N];
  int8_t dtype[N];  // DtypeCode, read by the fused cast
  int32_t count;
  int64_t lo;  // index of tensor 0 in the op's list
};

// The plan rows on the device (int32 or int64, any strides).
struct Plan {
  const void* data;
  int64_t s0, s1, n_rows;
  bool is64;

  __device__ int64_t at(int64_t r, int k) const {
    const int64_t o = r * s0 + k * s1;
    return is64 ? ld_plan(static_cast<const int64_t*>(data) + o)
                : static_cast<int64_t>(ld_plan(static_cast<const int32_t*>(data) + o));
  }
};

struct Launch {
  Plan plan;
  int64_t batch;
  int64_t n_reads_total;   // forward: rows reading a tensor outside [0, this) are no-ops
  int64_t tile_rows;       // batch rows per copy block
  int64_t zero_blocks;     // the first blocks of the grid, each taking a run of zero tiles
  int64_t zero_tiles;      // zero_col_tiles x chunks of zero_rows batch rows
  int64_t zero_col_tiles;  // of zero_cols columns of the written tensors side by side
  int64_t zero_rows;       // batch rows per zero tile
  int64_t total_cols;      // columns of this launch's written tensors, side by side
};

struct Row {
  int64_t read_t, write_t, read_off, write_off, length;
};

// Row r read in the direction of the pass: the forward reads inputs, the backward reads
// gradient outputs (columns 1 and 3) and writes input gradients (0 and 2).
template <bool kBackward>
__device__ Row load_row(const Plan& p, int64_t r) {
  Row row;
  row.read_t = p.at(r, kBackward ? 1 : 0);
  row.write_t = p.at(r, kBackward ? 0 : 1);
  row.read_off = p.at(r, kBackward ? 3 : 2);
  row.write_off = p.at(r, kBackward ? 2 : 3);
  row.length = p.at(r, 4);
  return row;
}

// The columns c in [lo, hi) of a segment (column off + c, c in [0, length)) that lie
// inside [0, width); empty (lo >= hi) when none do. No overflow for any int64 values.
struct Span {
  int64_t lo, hi;
};
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) {
  return a > b ? a : b;
}
__device__ Span clip(int64_t off, int64_t length, int64_t width) {
  if (length <= 0 || width <= 0 || off < -length) return {0, 0};
  const int64_t lo = off >= 0 ? 0 : -off;  // -off <= length
  int64_t hi;
  if (off >= 0) {
    hi = off >= width ? 0 : imin(length, width - off);
  } else {  // width + (-off) fits in uint64
    const uint64_t room = static_cast<uint64_t>(width) + static_cast<uint64_t>(-off);
    hi = room < static_cast<uint64_t>(length) ? static_cast<int64_t>(room) : length;
  }
  return {lo, hi};
}

// Whether a row writes in this launch, and which columns of its written tensor.
template <bool kBackward, int NW>
__device__ bool writes(
    const Row& row, const Tensors<NW>& w, const Launch& L, int64_t& wt, Span& s) {
  wt = row.write_t - w.lo;
  if (wt < 0 || wt >= w.count) return false;
  if (!kBackward && (row.read_t < 0 || row.read_t >= L.n_reads_total)) {
    return false;  // reads nothing: its columns are zero-filled
  }
  s = clip(row.write_off, row.length, w.width[wt]);
  return s.lo < s.hi;
}

// Calls load(b, j) then store(b, j, value) for each element (b, j) of a rows x cols tile,
// U loads in flight per thread; consecutive threads take consecutive columns.
template <typename T, int U = kUnroll, typename Load, typename Store>
__device__ void for_tile(int64_t rows, int64_t cols, Load load, Store store) {
  const int64_t total = rows * cols;
  if (total <= 0) return;
  // Stepping by kThreads elements without a division per element.
  const int64_t step_b = kThreads / cols, step_j = kThreads % cols;
  int64_t b = threadIdx.x / cols, j = threadIdx.x % cols;
  tile_begins();
  for (int64_t i = threadIdx.x; i < total; i += int64_t(kThreads) * U) {
    tile_step();
    T v[U];
    int64_t bs[U], js[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      bs[u] = b;
      js[u] = j;
      if (i + int64_t(u) * kThreads < total) v[u] = load(b, j);
      b += step_b;
      j += step_j;
      if (j >= cols) {
        j -= cols;
        ++b;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + int64_t(u) * kThreads < total) store(bs[u], js[u], v[u]);
    }
  }
}

// A plain element of ES bytes (a byte copy moves any dtype).
template <int ES>
struct Bytes;
template <>
struct Bytes<1> {
  using type = uint8_t;
};
template <>
struct Bytes<2> {
  using type = uint16_t;
};
template <>
struct Bytes<4> {
  using type = uint32_t;
};
template <>
struct Bytes<8> {
  using type = uint64_t;
};
struct alignas(8) Pair64 {
  uint64_t a, b;
};
template <>
struct Bytes<16> {
  using type = Pair64;
};

// Whether some column of the zero tile [c0, c0 + n_cols) is written by no plan row, on
// every thread (a barrier): covered[] (kCols, shared) marks the columns that
// cols(r, a, e) (plan row r writes flat columns [a, e); false: none) covers.
template <int kCols, typename Cols>
__device__ bool tile_has_gap(bool* covered, int64_t n_rows, int64_t c0, int64_t n_cols, Cols cols) {
  for (int k = threadIdx.x; k < kCols; k += kThreads) covered[k] = false;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < n_rows; r += kThreads) {
    int64_t a, e;
    if (!cols(r, a, e)) continue;
    a = imax(a, c0);
    e = imin(e, c0 + n_cols);
    for (int64_t c = a; c < e; ++c) covered[c - c0] = true;
  }
  __syncthreads();
  bool any = false;
  for (int64_t k = threadIdx.x; k < n_cols; k += kThreads) any |= !covered[k];
  return __syncthreads_or(any);
}

// Zero block blk: zero tiles [blk * T / Z, (blk + 1) * T / Z) of T = zero_tiles, Z =
// zero_blocks (few blocks, so that where the plan leaves no gap, as a rule, few are
// idle). Tile z is column tile z / chunks (kDenseZeroCols columns of this launch's
// written tensors side by side), batch rows (z % chunks) * zero_rows on: consecutive
// tiles share their columns, so the block marks in shared memory the columns some row
// writes (scanning the plan) once per column tile, then fills the others with zeros
// (all-zero bytes: +0.0, 0, false) for each tile's batch rows.
template <bool kBackward, int ES, int NW>
__device__ void zero_block(const Launch& L, const Tensors<NW>& w, int64_t blk) {
  using E = typename Bytes<ES>::type;
  __shared__ bool covered[kDenseZeroCols];
  __shared__ int64_t first[NW + 1];  // first flat column of each written tensor
  if (threadIdx.x == 0) {
    first[0] = 0;
    for (int k = 0; k < w.count; ++k) first[k + 1] = first[k] + w.width[k];
  }
  const int64_t chunks = L.zero_tiles / L.zero_col_tiles;
  const int64_t z1 = (blk + 1) * L.zero_tiles / L.zero_blocks;
  int64_t marked = -1;  // the column tile covered[] holds
  bool gap = false;
  for (int64_t z = blk * L.zero_tiles / L.zero_blocks; z < z1; ++z) {
    const int64_t c0 = (z / chunks) * kDenseZeroCols;
    const int64_t n_cols = imin(kDenseZeroCols, L.total_cols - c0);
    if (z / chunks != marked) {
      marked = z / chunks;
      __syncthreads();  // first[] written; covered[] read by the previous tile
      gap = tile_has_gap<kDenseZeroCols>(
          covered, L.plan.n_rows, c0, n_cols, [&](int64_t r, int64_t& a, int64_t& e) {
            const Row row = load_row<kBackward>(L.plan, r);
            int64_t wt;
            Span s;
            if (!writes<kBackward>(row, w, L, wt, s)) return false;
            a = first[wt] + row.write_off + s.lo;  // flat columns, inside the tensor
            e = first[wt] + row.write_off + s.hi;
            return true;
          });
    }
    if (!gap) continue;
    const int64_t b0 = (z % chunks) * L.zero_rows;
    const int64_t b1 = imin(L.batch, b0 + L.zero_rows);
    tile_begins();
    for (int64_t k = threadIdx.x; k < n_cols; k += kThreads) {
      tile_step();
      if (covered[k]) continue;
      const int64_t c = c0 + k;
      int t = 0;
      while (t + 1 < w.count && c >= first[t + 1]) ++t;
      E* dst = reinterpret_cast<E*>(const_cast<char*>(w.ptr[t])) + (c - first[t]);
      const int64_t rs = w.row_stride[t];
      for (int64_t b = b0; b < b1; ++b) st<__LINE__>(dst + b * rs, E{});
    }
  }
}

// Bytes [m, m + 16) of the 32 bytes lo:hi (little-endian), m in [0, 16): funnel shifts of
// neighbouring 32-bit words, picked by selects so that nothing is indexed at run time.
__device__ __forceinline__ uint4 shift_bytes(const uint4& lo, const uint4& hi, int m) {
  const uint32_t x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const int q = m >> 2, r = (m & 3) * 8;
  uint32_t y[5];
#pragma unroll
  for (int k = 0; k < 5; ++k) {
    y[k] = q == 0 ? x[k] : q == 1 ? x[k + 1] : q == 2 ? x[k + 2] : x[k + 3];
  }
  uint4 v;
  v.x = __funnelshift_r(y[0], y[1], r);
  v.y = __funnelshift_r(y[1], y[2], r);
  v.z = __funnelshift_r(y[2], y[3], r);
  v.w = __funnelshift_r(y[3], y[4], r);
  return v;
}

// A contiguous segment (column stride 1) of n bytes per row whose rows are not all 16-byte
// aligned, elements of ES bytes: each row as a head up to its destination's next 16-byte
// boundary, 16-byte stores, and a tail; head and tail element by element. A 16-byte
// store's bytes are read as the aligned 16-byte words that hold them (two where source
// and destination are misaligned relative to each other) and combined by shift_bytes, so
// every access is aligned and a warp's lanes touch consecutive words of a row. Batch row
// b0 + b (b in [0, rows)) is written at dst + (b0 + b) * drs and read at src + from *
// srs, from = row_of(b0 + b) (-1: zeros); strides in bytes.
template <int ES, typename RowOf>
__device__ void copy_shifted(
    const char* src,
    int64_t srs,
    char* dst,
    int64_t drs,
    int64_t n,
    int64_t b0,
    int64_t rows,
    RowOf row_of) {
  using E = typename Bytes<ES>::type;
  const auto head = [&](const char* d) {
    return imin(n, static_cast<int64_t>((0 - reinterpret_cast<uintptr_t>(d)) & 15));
  };
  // Two units in flight per thread: four loads where source and destination are
  // misaligned relative to each other, in fewer registers than four units would take.
  for_tile<uint4, 2>(
      rows, n / 16,
      [&](int64_t b, int64_t j) {
        const char* d = dst + (b0 + b) * drs;
        const int64_t h = head(d), from = row_of(b0 + b);
        if (16 * (j + 1) > n - h || from < 0) return uint4{0, 0, 0, 0};
        const char* p = src + from * srs + h + 16 * j;
        const int m = static_cast<int>(reinterpret_cast<uintptr_t>(p) & 15);
        const uint4* w = reinterpret_cast<const uint4*>(p - m);
        const uint4 lo = ld<__LINE__>(w);
        return m == 0 ? lo : shift_bytes(lo, ld<__LINE__>(w + 1), m);
      },
      [&](int64_t b, int64_t j, const uint4& v) {
        char* d = dst + (b0 + b) * drs;
        const int64_t h = head(d);
        if (16 * (j + 1) <= n - h) st<__LINE__>(reinterpret_cast<uint4*>(d + h + 16 * j), v);
      });
  // Element e of a row's head and tail: its byte offset in the row, or -1 past them.
  const auto edge = [&](const char* d, int64_t e) {
    const int64_t h = head(d), t = (n - h) % 16;
    if (e * ES < h) return e * ES;
    return e * ES - h < t ? n - t + (e * ES - h) : int64_t(-1);
  };
  for_tile<E>(
      rows, imin(n / ES, 2 * (16 / ES - 1)),
      [&](int64_t b, int64_t e) {
        const int64_t o = edge(dst + (b0 + b) * drs, e), from = row_of(b0 + b);
        return o >= 0 && from >= 0 ? ld<__LINE__>(reinterpret_cast<const E*>(src + from * srs + o))
                                   : E{};
      },
      [&](int64_t b, int64_t e, const E& v) {
        char* d = dst + (b0 + b) * drs;
        const int64_t o = edge(d, e);
        if (o >= 0) st<__LINE__>(reinterpret_cast<E*>(d + o), v);
      });
}

// A copy block's work as a byte copy (elements of ES bytes, an input of the output's
// dtype): columns [s.lo, s.hi) of `row`'s segment (s inside the output) for batch rows
// [b0, b0 + rows), batch row b read from input row row_of(b) (b itself, or through the
// VBE op's index; -1: zeros).
template <int ES, typename RowOf>
__device__ void copy_segment(
    const Row& row,
    Span s,
    const char* in_ptr,
    int64_t srs,
    int64_t scs,
    int64_t in_width,
    char* out_ptr,
    int64_t drs,
    int64_t b0,
    int64_t rows,
    RowOf row_of) {
  using E = typename Bytes<ES>::type;
  const int64_t cols = s.hi - s.lo;
  char* dst = out_ptr + (row.write_off + s.lo) * ES;
  const Span rd = clip(row.read_off, row.length, in_width);
  const bool readable = rd.lo <= s.lo && rd.hi >= s.hi;  // every column of the tile
  if (readable) {
    const char* src = in_ptr + (row.read_off + s.lo) * scs * ES;
    const int64_t row_bytes = cols * ES;
    if ((scs == 1 || cols == 1) && row_bytes % 16 == 0 && (drs * ES) % 16 == 0 &&
        (srs * ES) % 16 == 0 && (reinterpret_cast<uintptr_t>(dst) % 16) == 0 &&
        (reinterpret_cast<uintptr_t>(src) % 16) == 0) {
      const int64_t v_srs = srs * ES / 16, v_drs = drs * ES / 16;
      const uint4* vs = reinterpret_cast<const uint4*>(src);
      uint4* vd = reinterpret_cast<uint4*>(dst) + b0 * v_drs;
      for_tile<uint4>(
          rows, row_bytes / 16,
          [&](int64_t b, int64_t j) {
            const int64_t from = row_of(b0 + b);
            return from >= 0 ? ld<__LINE__>(vs + from * v_srs + j) : uint4{0, 0, 0, 0};
          },
          [&](int64_t b, int64_t j, const uint4& v) { st<__LINE__>(vd + b * v_drs + j, v); });
      return;
    }
    if constexpr (ES <= 8) {
      if (scs == 1) {
        return copy_shifted<ES>(src, srs * ES, dst, drs * ES, row_bytes, b0, rows, row_of);
      }
    }
  }
  const E* src = reinterpret_cast<const E*>(in_ptr);
  E* d = reinterpret_cast<E*>(dst);
  for_tile<E>(
      rows, cols,
      [&](int64_t b, int64_t j) {
        const int64_t c = s.lo + j, from = row_of(b0 + b);
        return (c >= rd.lo && c < rd.hi && from >= 0)
                   ? ld<__LINE__>(src + from * srs + (row.read_off + c) * scs)
                   : E{};
      },
      [&](int64_t b, int64_t j, const E& v) { st<__LINE__>(d + (b0 + b) * drs + j, v); });
}

// A copy block of the forward: its row's segment for its tile of batch rows.
template <int ES>
__device__ void copy_block(
    const Launch& L, const Tensors<kMaxTensors>& in, const Tensors<kMaxTensors>& out, int64_t blk) {
  const int64_t r = blk % L.plan.n_rows;
  const Row row = load_row<false>(L.plan, r);
  int64_t wt;
  Span s;
  if (!writes<false>(row, out, L, wt, s)) return;
  const int64_t rt = row.read_t - in.lo;
  if (rt < 0 || rt >= in.count) return;  // another launch's input
  const int64_t b0 = (blk / L.plan.n_rows) * L.tile_rows;
  copy_segment<ES>(
      row, s, in.ptr[rt], in.row_stride[rt], in.col_stride[rt], in.width[rt],
      const_cast<char*>(out.ptr[wt]), out.row_stride[wt], b0, imin(L.batch - b0, L.tile_rows),
      [](int64_t b) { return b; });
}

// The forward as a byte copy.
template <int ES>
__global__ void __launch_bounds__(kThreads) permute_copy_kernel(
    const Launch L, const Tensors<kMaxTensors> in, const Tensors<kMaxTensors> out) {
  const int64_t blk = blockIdx.x;
  if (blk < L.zero_blocks) return zero_block<false, ES>(L, out, blk);
  copy_block<ES>(L, in, out, blk - L.zero_blocks);
}

// x converted as torch's .to() converts it (c10's rounding; float16/bfloat16 from float).
template <typename Dst, typename Src>
__device__ __forceinline__ Dst convert(Src x) {
  return static_cast<Dst>(x);
}

__device__ __forceinline__ int code_bytes(int8_t code) {
  return code == kF64 ? 8 : code == kF32 ? 4 : 2;
}

template <typename Dst>
__device__ __forceinline__ Dst load_as(const char* p, int8_t code) {
  switch (code) {
    case kF32:
      return convert<Dst>(ld<__LINE__>(reinterpret_cast<const float*>(p)));
    case kF64:
      return convert<Dst>(ld<__LINE__>(reinterpret_cast<const double*>(p)));
    case kF16:
      return convert<Dst>(static_cast<float>(ld<__LINE__>(reinterpret_cast<const c10::Half*>(p))));
    default:
      return convert<Dst>(
          static_cast<float>(ld<__LINE__>(reinterpret_cast<const c10::BFloat16*>(p))));
  }
}

// The forward with the cast fused in: inputs of float dtypes (each its own), outputs Dst.
template <typename Dst>
__global__ void __launch_bounds__(kThreads) permute_cast_kernel(
    const Launch L, const Tensors<kMaxTensors> in, const Tensors<kMaxTensors> out) {
  int64_t blk = blockIdx.x;
  if (blk < L.zero_blocks) return zero_block<false, sizeof(Dst)>(L, out, blk);
  blk -= L.zero_blocks;
  const Row row = load_row<false>(L.plan, blk % L.plan.n_rows);
  int64_t wt;
  Span s;
  if (!writes<false>(row, out, L, wt, s)) return;
  const int64_t rt = row.read_t - in.lo;
  if (rt < 0 || rt >= in.count) return;
  const int64_t b0 = (blk / L.plan.n_rows) * L.tile_rows;
  const int64_t rows = imin(L.batch - b0, L.tile_rows);
  Dst* dst = reinterpret_cast<Dst*>(const_cast<char*>(out.ptr[wt])) + row.write_off + s.lo;
  const int64_t drs = out.row_stride[wt];
  const Span rd = clip(row.read_off, row.length, in.width[rt]);
  const char* src = in.ptr[rt];
  const int64_t srs = in.row_stride[rt], scs = in.col_stride[rt];
  const int8_t code = in.dtype[rt];
  const int es = code_bytes(code);
  for_tile<Dst>(
      rows, s.hi - s.lo,
      [&](int64_t b, int64_t j) {
        const int64_t c = s.lo + j;
        if (c < rd.lo || c >= rd.hi) return Dst(0);
        return load_as<Dst>(src + ((b0 + b) * srs + (row.read_off + c) * scs) * es, code);
      },
      [&](int64_t b, int64_t j, const Dst& v) { st<__LINE__>(dst + (b0 + b) * drs + j, v); });
}

template <typename T>
struct Accumulate {
  using type = T;
};
template <>
struct Accumulate<c10::Half> {
  using type = float;
};
template <>
struct Accumulate<c10::BFloat16> {
  using type = float;
};

template <typename T>
__host__ __device__ constexpr DtypeCode code_of() {
  return std::is_same_v<T, float>       ? kF32
         : std::is_same_v<T, double>    ? kF64
         : std::is_same_v<T, c10::Half> ? kF16
                                        : kBF16;
}

// A backward row's columns [lo, hi) of its input gradient wt (column x = write_off + c),
// and of those the ones its gradient block adds to (`adds`: read inside the gradient;
// empty where the gradient is outside the list or undefined). False: it writes nothing
// in this launch.
template <int NW>
__device__ bool backward_span(
    const Row& row,
    const Tensors<kMaxReads>& grads,
    const Tensors<NW>& out,
    const Launch& L,
    int64_t& wt,
    Span& cols,
    Span& adds) {
  Span s;
  if (!writes<true>(row, out, L, wt, s)) return false;
  cols = {row.write_off + s.lo, row.write_off + s.hi};
  adds = {0, 0};
  const int64_t gt = row.read_t;  // gradient outputs are never chunked
  if (gt >= 0 && gt < grads.count) {
    const Span rd = clip(row.read_off, row.length, grads.width[gt]);
    const int64_t lo = imax(rd.lo, s.lo), hi = imin(rd.hi, s.hi);
    if (lo < hi) adds = {row.write_off + lo, row.write_off + hi};
  }
  return true;
}

// One gradient block adding to input-gradient columns x in [lo, hi): it reads
// grads[t][b, x + shift].
struct Link {
  const char* ptr;
  int64_t rs, cs, shift, lo, hi;
  int8_t code;  // the gradient's DtypeCode
};

// `adds` non-empty: both read_off + c and write_off + c lie inside their tensors, so
// `shift` (their difference) cannot overflow.
__device__ Link link_of(const Row& row, const Tensors<kMaxReads>& grads, Span adds) {
  const int64_t gt = row.read_t;
  return Link{grads.ptr[gt],
              grads.row_stride[gt],
              grads.col_stride[gt],
              row.read_off - row.write_off,
              adds.lo,
              adds.hi,
              grads.dtype[gt]};
}

constexpr int kMaxLinks = 32;  // rows a block lists; with more, each element walks the plan
// A run [lo, hi) of the columns a block owns with one set of gradient blocks: bit k of
// `links` set where Sums::links[k] adds (bit order is plan order).
struct Piece {
  int64_t lo, hi;
  uint32_t links;
};
static_assert(kMaxLinks <= 32, "one bit per link");
constexpr int kMaxPieces = 4 * kMaxLinks + 1;  // runs between 4 * kMaxLinks + 2 ends

// What a backward block of row r sums over its columns, found in the plan (no column 5:
// torchrec's chains, which the CPU kernel does not read either). Of r's columns, those an
// earlier row writes are the earlier row's (its block sums them); r's block sums, on the
// others, the gradient blocks of r and of every later row writing them, in plan order:
// the CPU kernel's sums, so its bits, whatever the plan's duplicates.
struct Sums {
  Link links[kMaxLinks];    // rows r and later adding to r's columns, in plan order
  Span earlier[kMaxLinks];  // columns of r's that earlier rows write
  Piece pieces[kMaxPieces];
  int n_links, n_earlier, n_pieces;
  bool walk;  // more rows than listed: every element walks the plan (walk_column)
  bool none;  // earlier rows write all of r's columns: the block does nothing
};

// Whether the spans cover [cols.lo, cols.hi).
__device__ bool covers(const Span* spans, int n, Span cols) {
  int64_t x = cols.lo;
  for (bool grew = true; x < cols.hi && grew;) {
    grew = false;
    for (int k = 0; k < n; ++k) {
      if (spans[k].lo <= x && x < spans[k].hi) {
        x = spans[k].hi;
        grew = true;
      }
    }
  }
  return x >= cols.hi;
}

// The runs of r's own columns with one set of links (one thread).
__device__ void build_pieces(Sums& S, Span cols) {
  int64_t ends[2 + 4 * kMaxLinks];
  int n = 0;
  ends[n++] = cols.lo;
  ends[n++] = cols.hi;
  for (int k = 0; k < S.n_earlier; ++k) {
    ends[n++] = S.earlier[k].lo;
    ends[n++] = S.earlier[k].hi;
  }
  for (int k = 0; k < S.n_links; ++k) {
    ends[n++] = S.links[k].lo;
    ends[n++] = S.links[k].hi;
  }
  for (int i = 1; i < n; ++i) {  // insertion sort: a handful of ends, as a rule
    const int64_t v = ends[i];
    int j = i;
    for (; j > 0 && ends[j - 1] > v; --j) ends[j] = ends[j - 1];
    ends[j] = v;
  }
  for (int i = 0; i + 1 < n; ++i) {
    const int64_t a = ends[i], e = ends[i + 1];
    if (a == e) continue;
    bool owned = true;
    for (int k = 0; k < S.n_earlier; ++k) owned &= !(S.earlier[k].lo <= a && a < S.earlier[k].hi);
    if (!owned) continue;
    uint32_t mask = 0;
    for (int k = 0; k < S.n_links; ++k) {
      if (S.links[k].lo <= a && a < S.links[k].hi) mask |= uint32_t(1) << k;
    }
    Piece* last = S.n_pieces > 0 ? &S.pieces[S.n_pieces - 1] : nullptr;
    if (last && last->hi == a && last->links == mask) {
      last->hi = e;
    } else {
      S.pieces[S.n_pieces++] = Piece{a, e, mask};
    }
  }
}

// Fills S from the plan rows that add to `cols`: the plan is scanned kThreads rows at a
// time, each thread testing one row (hit(k)), then one thread takes the rows hit, in plan
// order (take(k), until S.walk), and calls chunk_done(k0); the scan stops once S.walk or
// S.none. Then the pieces of `cols` are built.
template <typename Hit, typename Take, typename ChunkDone>
__device__ void scan_sums(
    int64_t n_rows, Span cols, Sums& S, Hit hit, Take take, ChunkDone chunk_done) {
  __shared__ bool hits[kThreads];
  if (threadIdx.x == 0) {
    S.n_links = S.n_earlier = S.n_pieces = 0;
    S.walk = S.none = false;
  }
  for (int64_t k0 = 0; k0 < n_rows; k0 += kThreads) {
    const int64_t k = k0 + threadIdx.x;
    const bool h = k < n_rows && hit(k);
    hits[threadIdx.x] = h;
    if (!__syncthreads_or(h)) continue;  // as a rule: rows of other keys only
    if (threadIdx.x == 0) {
      for (int t = 0; t < kThreads && !S.walk; ++t) {
        if (hits[t]) take(k0 + t);
      }
      chunk_done(k0);
    }
    __syncthreads();
    if (S.walk || S.none) return;
  }
  if (threadIdx.x == 0) build_pieces(S, cols);
  __syncthreads();
}

// Fills S for the block of row r (columns `cols` of input gradient wt): the rows that
// write any of r's columns.
template <int NW>
__device__ void find_sums(
    const Launch& L,
    const Tensors<kMaxReads>& grads,
    const Tensors<NW>& out,
    int64_t r,
    int64_t wt,
    Span cols,
    Sums& S) {
  scan_sums(
      L.plan.n_rows, cols, S,
      [&](int64_t k) {
        int64_t ot;
        Span oc, oa;
        return backward_span(load_row<true>(L.plan, k), grads, out, L, ot, oc, oa) && ot == wt &&
               oc.lo < cols.hi && cols.lo < oc.hi;
      },
      [&](int64_t k) {
        const Row o = load_row<true>(L.plan, k);
        int64_t ot;
        Span oc, oa;
        backward_span(o, grads, out, L, ot, oc, oa);
        if (k < r) {
          if (S.n_earlier == kMaxLinks) {
            S.walk = true;
          } else {
            S.earlier[S.n_earlier++] = Span{imax(oc.lo, cols.lo), imin(oc.hi, cols.hi)};
          }
          return;
        }
        const Span a{imax(oa.lo, cols.lo), imin(oa.hi, cols.hi)};
        if (a.lo >= a.hi) return;  // adds nothing here
        if (S.n_links == kMaxLinks) {
          S.walk = true;
        } else {
          S.links[S.n_links++] = link_of(o, grads, a);
        }
      },
      [&](int64_t k0) {  // every earlier row is listed once r's own chunk is
        if (!S.walk && k0 <= r && r < k0 + kThreads) S.none = covers(S.earlier, S.n_earlier, cols);
      });
}

// Where S.walk: whether row r's block owns column x (no earlier row writes it), calling
// f(link) for each gradient block adding to x, in plan order, where it does.
template <int NW, typename F>
__device__ bool walk_column(
    const Launch& L,
    const Tensors<kMaxReads>& grads,
    const Tensors<NW>& out,
    int64_t r,
    int64_t wt,
    int64_t x,
    F f) {
  for (int64_t k = 0; k < L.plan.n_rows; ++k) {
    const Row o = load_row<true>(L.plan, k);
    int64_t ot;
    Span oc, oa;
    if (!backward_span(o, grads, out, L, ot, oc, oa) || ot != wt || x < oc.lo || x >= oc.hi) {
      continue;
    }
    if (k < r) return false;
    if (x >= oa.lo && x < oa.hi) f(link_of(o, grads, oa));
  }
  return true;
}

__device__ __forceinline__ int link_count(uint32_t mask) {
  int n = 0;
  for (; mask; mask &= mask - 1) ++n;
  return n;
}

__device__ __forceinline__ int first_link(uint32_t mask) {
  int k = 0;
  while (!(mask >> k & 1)) ++k;
  return k;
}

// The backward: each block sums the gradient blocks of the columns its row owns
// (find_sums) into input gradients (D), from gradients of any float dtype (read at run
// time), as the CPU kernel sums them: a column one block adds to keeps that value's bits
// (D's dtype) or is converted through Acc; several are summed in plan order, in Acc
// (float32 for float16/bfloat16), each addition done in `Compute` (PyTorch's promotion
// of an accumulator and a gradient: double where either is double, else float).
template <typename D, typename Compute>
__global__ void __launch_bounds__(kThreads) permute_backward_kernel(
    const Launch L, const Tensors<kMaxReads> grads, const Tensors<kMaxTensors> out) {
  using Acc = typename Accumulate<D>::type;
  int64_t blk = blockIdx.x;
  if (blk < L.zero_blocks) return zero_block<true, sizeof(D)>(L, out, blk);
  blk -= L.zero_blocks;
  const int64_t r = blk % L.plan.n_rows;
  int64_t wt;
  Span cols, adds;
  if (!backward_span(load_row<true>(L.plan, r), grads, out, L, wt, cols, adds)) return;
  __shared__ Sums S;
  find_sums(L, grads, out, r, wt, cols, S);
  if (S.none) return;
  const int64_t b0 = (blk / L.plan.n_rows) * L.tile_rows;
  const int64_t rows = imin(L.batch - b0, L.tile_rows);
  const int64_t drs = out.row_stride[wt];
  D* const dst = reinterpret_cast<D*>(const_cast<char*>(out.ptr[wt])) + b0 * drs;
  // Gradient element (b0 + b, column x) of link l.
  const auto at = [&](const Link& l, int64_t b, int64_t x) {
    return l.ptr + ((b0 + b) * l.rs + (x + l.shift) * l.cs) * code_bytes(l.code);
  };
  const auto first = [](const char* p, int8_t code) {
    return static_cast<Acc>(load_as<Compute>(p, code));
  };
  const auto add = [](Acc acc, const char* p, int8_t code) {
    return static_cast<Acc>(static_cast<Compute>(acc) + load_as<Compute>(p, code));
  };
  if (S.walk) {
    tile_begins();
    for (int64_t i = threadIdx.x; i < rows * (cols.hi - cols.lo); i += kThreads) {
      tile_step();
      const int64_t b = i / (cols.hi - cols.lo), x = cols.lo + i % (cols.hi - cols.lo);
      Acc acc = Acc(0);
      const char* one = nullptr;
      int8_t one_code = kOther;
      int n = 0;
      const bool owned = walk_column(L, grads, out, r, wt, x, [&](const Link& l) {
        const char* p = at(l, b, x);
        acc = n == 0 ? first(p, l.code) : add(acc, p, l.code);
        one = p;
        one_code = l.code;
        ++n;
      });
      if (!owned) continue;
      st<__LINE__>(
          dst + b * drs + x, n == 1 && one_code == code_of<D>()
                                 ? ld<__LINE__>(reinterpret_cast<const D*>(one))
                                 : static_cast<D>(acc));
    }
    return;
  }
  for (int q = 0; q < S.n_pieces; ++q) {
    const Piece pc = S.pieces[q];
    const int64_t width = pc.hi - pc.lo;
    const int n = link_count(pc.links);
    D* const d = dst + pc.lo;
    if (n == 1 && S.links[first_link(pc.links)].code == code_of<D>()) {
      // One gradient block of D's dtype: its bits, in 16-byte vectors where aligned.
      const Link l = S.links[first_link(pc.links)];
      const char* src = at(l, 0, pc.lo);
      constexpr int64_t es = sizeof(D);
      if (l.cs == 1 && (width * es) % 16 == 0 && (l.rs * es) % 16 == 0 && (drs * es) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0) {
        const uint4* vs = reinterpret_cast<const uint4*>(src);
        uint4* vd = reinterpret_cast<uint4*>(d);
        const int64_t v_srs = l.rs * es / 16, v_drs = drs * es / 16;
        for_tile<uint4>(
            rows, width * es / 16,
            [&](int64_t b, int64_t j) { return ld<__LINE__>(vs + b * v_srs + j); },
            [&](int64_t b, int64_t j, const uint4& v) { st<__LINE__>(vd + b * v_drs + j, v); });
      } else if (l.cs == 1) {
        // Contiguous but misaligned: the forward's head, shifted 16-byte words and tail.
        copy_shifted<static_cast<int>(es)>(
            src, l.rs * es, reinterpret_cast<char*>(d), drs * es, width * es, 0, rows,
            [](int64_t b) { return b; });
      } else {
        const D* s = reinterpret_cast<const D*>(src);
        for_tile<D>(
            rows, width,
            [&](int64_t b, int64_t j) { return ld<__LINE__>(s + b * l.rs + j * l.cs); },
            [&](int64_t b, int64_t j, const D& v) { st<__LINE__>(d + b * drs + j, v); });
      }
      continue;
    }
    for_tile<Acc>(
        rows, width,
        [&](int64_t b, int64_t j) {
          const int64_t x = pc.lo + j;
          Acc acc = Acc(0);
          bool started = false;
          for (int k = 0; k < S.n_links; ++k) {
            if (!(pc.links >> k & 1)) continue;
            const Link& l = S.links[k];
            acc = started ? add(acc, at(l, b, x), l.code) : first(at(l, b, x), l.code);
            started = true;
          }
          return acc;
        },
        [&](int64_t b, int64_t j, const Acc& v) {
          st<__LINE__>(d + b * drs + j, static_cast<D>(v));
        });
  }
}

// ---- the variable-batch ops' device code (permute_multi_embedding_vbe{,_backward}) -----

// Their tensors in a device table (any number of them: kernel parameters would not hold
// a thousand), int64 fields written on the host and copied to the device once per call;
// read through ld_plan, as the plan.
struct VbeIn {  // a forward input
  int64_t ptr, row_stride, col_stride, width, rows;
  int64_t index, index_stride, index_is64;  // index 0: batch row b reads row b
};
struct VbeOut {  // a forward output; first: its first column, the outputs side by side
  int64_t ptr, row_stride, width, first;
};
struct VbeGrad {  // an input gradient of the backward (rows x width, contiguous)
  int64_t ptr, width, rows;
  int64_t block_begin, row_tile, col_tile, col_tiles;  // its blocks: row tiles x column tiles
  int64_t key_base;   // the key of its row 0; -1: no index (row r is sample r)
  int64_t slot_base;  // the slot of its sample 0 (slots: the indexed inputs' samples in a row)
};
struct VbeIndex {  // an indexed input of the backward, for its samples' keys
  int64_t ptr, stride, is64, rows, key_base, input;
};

template <typename T>
__device__ __forceinline__ T* as_ptr(int64_t p) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

// Entry k of a table section.
template <typename S>
__device__ S entry(const S* section, int64_t k) {
  static_assert(sizeof(S) % sizeof(int64_t) == 0, "int64 fields only");
  constexpr int n = int(sizeof(S) / sizeof(int64_t));
  const int64_t* from = reinterpret_cast<const int64_t*>(section + k);
  int64_t fields[n];
#pragma unroll
  for (int f = 0; f < n; ++f) fields[f] = ld_plan(from + f);
  S s;
  memcpy(&s, fields, sizeof(S));  // registers to registers
  return s;
}

// The last k in [0, n) whose field (at `offset` int64s into entry k) is <= v; entries
// sorted by it (a prefix of counts). n >= 1.
template <typename S>
__device__ int64_t last_at_most(const S* section, int64_t n, int offset, int64_t v) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t m = lo + (hi - lo + 1) / 2;
    const int64_t f = ld_plan(reinterpret_cast<const int64_t*>(section + m) + offset);
    if (f <= v) {
      lo = m;
    } else {
      hi = m - 1;
    }
  }
  return lo;
}

constexpr int64_t kVbeTileRows = 1024;  // batch rows per VBE copy block, at most

struct VbeLaunch {
  Plan plan;
  const VbeIn* ins;
  const VbeOut* outs;
  int64_t n_ins, n_outs, batch;
  int64_t tile_rows;       // batch rows per copy block
  int64_t zero_blocks;     // the first blocks of the grid, each taking every zero_blocks-th tile
  int64_t zero_tiles;      // zero_col_tiles x chunks of zero_rows batch rows
  int64_t zero_col_tiles;  // of kZeroCols columns of the outputs side by side
  int64_t zero_rows;
  int64_t total_cols;
};

// Input `in`'s row for batch row b: b without an index; -1 (after the assert) for an
// index outside the input. `input`: its index in the op's list (for the message).
__device__ int64_t vbe_row(const VbeIn& in, int64_t b, int64_t input) {
  if (in.index == 0) return b;
  const int64_t o = b * in.index_stride;
  const int64_t v = in.index_is64
                        ? ld<__LINE__>(as_ptr<const int64_t>(in.index) + o)
                        : static_cast<int64_t>(ld<__LINE__>(as_ptr<const int32_t>(in.index) + o));
  const bool inside = v >= 0 && v < in.rows;
  KT_REGROUP_INDEX_ASSERT(
      inside,
      "kt_regroup.permute_multi_embedding_vbe: indices[%lld][%lld] = %lld is out of range "
      "for input %lld, which has %lld rows",
      static_cast<long long>(input), static_cast<long long>(b), static_cast<long long>(v),
      static_cast<long long>(input), static_cast<long long>(in.rows));
  return inside ? v : -1;
}

// Whether a forward row copies (tensors inside the lists, columns inside its output),
// its output and columns.
__device__ bool vbe_writes(const VbeLaunch& L, const Row& row, VbeOut& out, Span& s) {
  if (row.write_t < 0 || row.write_t >= L.n_outs || row.read_t < 0 || row.read_t >= L.n_ins) {
    return false;  // a no-op: its columns are zero-filled
  }
  out = entry(L.outs, row.write_t);
  s = clip(row.write_off, row.length, out.width);
  return s.lo < s.hi;
}

// Zero tile z of the VBE forward: the columns of its tile (of the outputs side by side)
// that no row writes, for its batch rows (as zero_block, the outputs from the table).
template <int ES>
__device__ void vbe_zero_tile(const VbeLaunch& L, int64_t z) {
  using E = typename Bytes<ES>::type;
  __shared__ bool covered[kZeroCols];
  const int64_t c0 = (z % L.zero_col_tiles) * kZeroCols;
  const int64_t n_cols = imin(kZeroCols, L.total_cols - c0);
  const bool gap = tile_has_gap<kZeroCols>(
      covered, L.plan.n_rows, c0, n_cols, [&](int64_t r, int64_t& a, int64_t& e) {
        const Row row = load_row<false>(L.plan, r);
        VbeOut out;
        Span s;
        if (!vbe_writes(L, row, out, s)) return false;
        a = out.first + row.write_off + s.lo;
        e = out.first + row.write_off + s.hi;
        return true;
      });
  if (!gap) return;
  const int64_t b0 = (z / L.zero_col_tiles) * L.zero_rows;
  const int64_t b1 = imin(L.batch, b0 + L.zero_rows);
  tile_begins();
  for (int64_t k = threadIdx.x; k < n_cols; k += kThreads) {
    tile_step();
    if (covered[k]) continue;
    const int64_t c = c0 + k;
    const VbeOut out = entry(L.outs, last_at_most(L.outs, L.n_outs, 3, c));  // first <= c
    E* dst = as_ptr<E>(out.ptr) + (c - out.first);
    for (int64_t b = b0; b < b1; ++b) st<__LINE__>(dst + b * out.row_stride, E{});
  }
}

// The VBE forward (permute_multi_embedding_vbe), one launch whatever the number of
// inputs: the zero blocks first (each every zero_blocks-th zero tile), then one block per
// (permute row, tile of batch rows), the byte copy through the inputs' indices.
template <int ES>
__global__ void __launch_bounds__(kThreads) vbe_copy_kernel(const VbeLaunch L) {
  int64_t blk = blockIdx.x;
  if (blk < L.zero_blocks) {
    for (int64_t z = blk; z < L.zero_tiles; z += L.zero_blocks) {
      vbe_zero_tile<ES>(L, z);
      __syncthreads();  // covered[] is the next tile's
    }
    return;
  }
  blk -= L.zero_blocks;
  const Row row = load_row<false>(L.plan, blk % L.plan.n_rows);
  VbeOut out;
  Span s;
  if (!vbe_writes(L, row, out, s)) return;
  const VbeIn in = entry(L.ins, row.read_t);
  const int64_t b0 = (blk / L.plan.n_rows) * L.tile_rows;
  const int64_t rows = imin(L.batch - b0, L.tile_rows);
  // The tile's input rows, read (and checked) once per batch row.
  __shared__ int64_t from[kVbeTileRows];
  tile_begins();
  for (int64_t b = threadIdx.x; b < rows; b += kThreads) {
    tile_step();
    from[b] = vbe_row(in, b0 + b, row.read_t);
  }
  __syncthreads();
  copy_segment<ES>(
      row, s, as_ptr<const char>(in.ptr), in.row_stride, in.col_stride, in.width,
      as_ptr<char>(out.ptr), out.row_stride, b0, rows, [&](int64_t b) { return from[b - b0]; });
}

// The backward's keys: slot s (sample b of the k-th indexed input, s = k * batch + b) has
// key key_base + indices[b] (its row among the indexed inputs' rows side by side); a
// stable sort of the keys then lists each row's samples in sample order. bounds[g] = g
// (g in [0, n_keys]) for the search of each key's first slot. Every index is checked.
struct VbeKeys {
  const VbeIndex* inputs;
  int64_t n_indexed, batch, n_keys;
  void* keys;    // n_indexed * batch of K
  void* bounds;  // n_keys + 1 of K
};

template <typename K>
__global__ void __launch_bounds__(kThreads) vbe_keys_kernel(const VbeKeys L) {
  const int64_t s = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (s <= L.n_keys) st<__LINE__>(static_cast<K*>(L.bounds) + s, static_cast<K>(s));
  if (s >= L.n_indexed * L.batch) return;
  const int64_t k = s / L.batch, b = s - k * L.batch;
  const VbeIndex x = entry(L.inputs, k);
  const int64_t o = b * x.stride;
  const int64_t v = x.is64 ? ld<__LINE__>(as_ptr<const int64_t>(x.ptr) + o)
                           : static_cast<int64_t>(ld<__LINE__>(as_ptr<const int32_t>(x.ptr) + o));
  const bool inside = v >= 0 && v < x.rows;
  KT_REGROUP_INDEX_ASSERT(
      inside,
      "kt_regroup.permute_multi_embedding_vbe_backward: indices[%lld][%lld] = %lld is out "
      "of range for input %lld, which has %lld rows",
      static_cast<long long>(x.input), static_cast<long long>(b), static_cast<long long>(v),
      static_cast<long long>(x.input), static_cast<long long>(x.rows));
  // An index outside its input sorts past every row: no row sums it.
  st<__LINE__>(static_cast<K*>(L.keys) + s, static_cast<K>(inside ? x.key_base + v : L.n_keys));
}

struct VbeBackLaunch {
  Plan plan;
  const VbeGrad* ins;  // the input gradients
  int64_t n_ins;
  const int64_t* starts;  // key g's samples: order[starts[g], starts[g + 1]); nullptr: none
  const int64_t* order;   // the slots by key, in slot order within a key
};

// Whether plan row `row` (read as the backward reads it) adds to columns `cols` of input
// gradient i (`width` wide), and its link there: its gradient defined, both segments
// clipped to their tensors.
__device__ bool vbe_link(
    const Row& row, const Tensors<kMaxReads>& grads, int64_t i, int64_t width, Span cols, Link& l) {
  const int64_t gt = row.read_t;
  if (row.write_t != i || gt < 0 || gt >= grads.count) return false;
  const Span s = clip(row.write_off, row.length, width);
  const Span rd = clip(row.read_off, row.length, grads.width[gt]);
  const int64_t lo = imax(s.lo, rd.lo), hi = imin(s.hi, rd.hi);
  if (lo >= hi) return false;
  const Span adds{imax(row.write_off + lo, cols.lo), imin(row.write_off + hi, cols.hi)};
  if (adds.lo >= adds.hi) return false;
  l = link_of(row, grads, adds);
  return true;
}

// Fills S for a block of input gradient i's columns `cols`: the plan rows adding to
// them, in plan order (the plan scanned kThreads rows at a time), and its pieces (runs
// of columns with one set of rows; a run no row adds to has none). More than kMaxLinks
// rows: S.walk.
__device__ void vbe_find_sums(
    const VbeBackLaunch& L,
    const Tensors<kMaxReads>& grads,
    int64_t i,
    int64_t width,
    Span cols,
    Sums& S) {
  scan_sums(
      L.plan.n_rows, cols, S,
      [&](int64_t k) {
        Link l;
        return vbe_link(load_row<true>(L.plan, k), grads, i, width, cols, l);
      },
      [&](int64_t k) {
        if (S.n_links == kMaxLinks) {
          S.walk = true;
        } else {
          vbe_link(load_row<true>(L.plan, k), grads, i, width, cols, S.links[S.n_links++]);
        }
      },
      [](int64_t) {});
}

// The VBE backward (permute_multi_embedding_vbe_backward), one launch whatever the
// number of inputs: one block per (input gradient, tile of its rows, tile of its
// columns), each writing every element of its tile once. Element (row, x) sums over the
// row's samples in sample order, each sample's gradient blocks in plan order, in Acc
// (float32 for float16/bfloat16): the CPU kernel's order (unpatched torchrec's), so its
// bits; a row without an index is its own sample, and one gradient block keeps its bits.
// Rows no sample reads and columns no row adds to get zeros. The gradients have D's
// dtype (the op checks it).
template <typename D>
__global__ void __launch_bounds__(kThreads)
    vbe_backward_kernel(const VbeBackLaunch L, const Tensors<kMaxReads> grads) {
  using Acc = typename Accumulate<D>::type;
  const int64_t blk = blockIdx.x;
  const int64_t i = last_at_most(L.ins, L.n_ins, 3, blk);  // block_begin <= blk
  const VbeGrad g = entry(L.ins, i);
  const int64_t local = blk - g.block_begin;
  const int64_t c0 = (local % g.col_tiles) * g.col_tile;
  const int64_t r0 = (local / g.col_tiles) * g.row_tile;
  const Span cols{c0, imin(g.width, c0 + g.col_tile)};
  const int64_t rows = imin(g.rows - r0, g.row_tile);
  __shared__ Sums S;
  vbe_find_sums(L, grads, i, g.width, cols, S);
  const int64_t drs = g.width;
  D* const dst = as_ptr<D>(g.ptr) + r0 * drs;
  const bool indexed = g.key_base >= 0;
  const int64_t* starts = indexed && L.starts ? L.starts + g.key_base + r0 : nullptr;
  const auto value = [](const Link& l, int64_t sample, int64_t x) {
    return ld<__LINE__>(reinterpret_cast<const D*>(l.ptr) + sample * l.rs + (x + l.shift) * l.cs);
  };
  // Row r0 + b, column x, over the links `each` calls.
  const auto element = [&](int64_t b, int64_t x, auto each) {
    if (!indexed) {  // row r is sample r
      Acc sum = Acc(0);
      int n = 0;
      D one{};
      each([&](const Link& l) {
        one = value(l, r0 + b, x);
        sum = n == 0 ? static_cast<Acc>(one) : sum + static_cast<Acc>(one);
        ++n;
      });
      return n == 1 ? one : static_cast<D>(sum);  // the CPU kernel copies one
    }
    Acc acc = Acc(0);
    if (starts == nullptr) return static_cast<D>(acc);  // no samples at all (batch 0)
    const int64_t q1 = ld<__LINE__>(starts + b + 1);
    for (int64_t q = ld<__LINE__>(starts + b); q < q1; ++q) {
      const int64_t sample = ld<__LINE__>(L.order + q) - g.slot_base;
      Acc sum = Acc(0);
      int n = 0;
      each([&](const Link& l) {
        const Acc v = static_cast<Acc>(value(l, sample, x));
        sum = n == 0 ? v : sum + v;
        ++n;
      });
      acc = acc + sum;
    }
    return static_cast<D>(acc);
  };
  if (S.walk) {  // more rows than listed: each element walks the plan
    const int64_t w = cols.hi - cols.lo;
    tile_begins();
    for (int64_t e = threadIdx.x; e < rows * w; e += kThreads) {
      tile_step();
      const int64_t b = e / w, x = cols.lo + e % w;
      st<__LINE__>(
          dst + b * drs + x, element(b, x, [&](auto add) {
            for (int64_t k = 0; k < L.plan.n_rows; ++k) {
              Link l;
              if (vbe_link(load_row<true>(L.plan, k), grads, i, g.width, Span{x, x + 1}, l)) {
                add(l);
              }
            }
          }));
    }
    return;
  }
  for (int q = 0; q < S.n_pieces; ++q) {
    const Piece pc = S.pieces[q];
    const int64_t width = pc.hi - pc.lo;
    D* const d = dst + pc.lo;
    if (pc.links == 0) {  // no row adds to these columns
      for_tile<D>(
          rows, width, [](int64_t, int64_t) { return static_cast<D>(Acc(0)); },
          [&](int64_t b, int64_t j, const D& v) { st<__LINE__>(d + b * drs + j, v); });
      continue;
    }
    if (!indexed && link_count(pc.links) == 1) {
      // One gradient block, row r its sample r: its bits, in 16-byte vectors where aligned.
      const Link l = S.links[first_link(pc.links)];
      const D* src = reinterpret_cast<const D*>(l.ptr) + r0 * l.rs + (pc.lo + l.shift) * l.cs;
      constexpr int64_t es = sizeof(D);
      if (l.cs == 1 && (width * es) % 16 == 0 && (l.rs * es) % 16 == 0 && (drs * es) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0) {
        const uint4* vs = reinterpret_cast<const uint4*>(src);
        uint4* vd = reinterpret_cast<uint4*>(d);
        const int64_t v_srs = l.rs * es / 16, v_drs = drs * es / 16;
        for_tile<uint4>(
            rows, width * es / 16,
            [&](int64_t b, int64_t j) { return ld<__LINE__>(vs + b * v_srs + j); },
            [&](int64_t b, int64_t j, const uint4& v) { st<__LINE__>(vd + b * v_drs + j, v); });
        continue;
      }
    }
    for_tile<D>(
        rows, width,
        [&](int64_t b, int64_t j) {
          return element(b, pc.lo + j, [&](auto add) {
            for (int k = 0; k < S.n_links; ++k) {
              if (pc.links >> k & 1) add(S.links[k]);
            }
          });
        },
        [&](int64_t b, int64_t j, const D& v) { st<__LINE__>(d + b * drs + j, v); });
  }
}

// A kernel's static shared memory (at most a zero block's, find_sums' and Sums) stays
// within the 48 KiB a launch gets without opting in.
static_assert(
    sizeof(bool) * kDenseZeroCols + sizeof(int64_t) * (kMaxTensors + 1) + sizeof(bool) * kThreads +
            sizeof(Sums) <=
        48 * 1024,
    "static shared memory over 48 KiB");

static_assert(
    sizeof(bool) * kZeroCols + sizeof(int64_t) * kVbeTileRows <= 48 * 1024,
    "static shared memory of the VBE forward over 48 KiB");

// A launch's arguments stay within the 4 KiB every CUDA version and GPU accepts.
static_assert(
    sizeof(Launch) + sizeof(Tensors<kMaxReads>) + sizeof(Tensors<kMaxTensors>) <= 4000 &&
        sizeof(VbeBackLaunch) + sizeof(Tensors<kMaxReads>) <= 4000 && sizeof(VbeLaunch) <= 4000,
    "kernel arguments over 4 KiB");

// ---- host side ------------------------------------------------------------------------

// `write`: the kernel writes these tensors, so their pointers are mutable_data_ptr()'s
// (a copy-on-write tensor, torch._lazy_clone's, gets storage of its own first; its
// const pointer is its source's).
template <int N>
Tensors<N> table(const TensorPtrs& tensors, size_t lo, size_t count, bool write = false) {
  Tensors<N> t{};
  t.count = static_cast<int32_t>(count);
  t.lo = static_cast<int64_t>(lo);
  for (size_t k = 0; k < count; ++k) {
    const at::Tensor* x = tensors[lo + k];
    if (x == nullptr) {  // an undefined gradient: width 0, never read
      t.dtype[k] = kOther;
      continue;
    }
    t.ptr[k] = static_cast<const char*>(write ? x->mutable_data_ptr() : x->const_data_ptr());
    t.row_stride[k] = x->stride(0);
    t.col_stride[k] = x->stride(1);
    t.width[k] = x->size(1);
    t.dtype[k] = dtype_code(x->scalar_type());
  }
  return t;
}

Plan device_plan(const at::Tensor& permutes) {
  return Plan{
      permutes.const_data_ptr(), permutes.stride(0), permutes.stride(1), permutes.size(0),
      permutes.scalar_type() == at::kLong};
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int64_t pow2_floor(int64_t x) {
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

// Grid and tile sizes of one launch writing `total_cols` columns (of `es`-byte elements),
// zero tiles of `zero_cols` columns.
Launch plan_launch(
    const at::Tensor& permutes,
    int64_t batch,
    int64_t n_reads_total,
    int64_t total_cols,
    int64_t es,
    bool zero_fill,
    int64_t zero_cols = kDenseZeroCols) {
  Launch L{};
  L.plan = device_plan(permutes);
  L.batch = batch;
  L.n_reads_total = n_reads_total;
  L.total_cols = total_cols;
  const int64_t n_rows = std::max<int64_t>(1, permutes.size(0));
  // Segments are about total_cols / n_rows wide: a tile of about kTileBytes.
  const int64_t row_bytes = std::max<int64_t>(1, total_cols / n_rows * es);
  L.tile_rows = std::min(pow2_floor(std::max<int64_t>(1, kTileBytes / row_bytes)), batch);
  if (zero_fill && total_cols > 0) {
    L.zero_col_tiles = ceil_div(total_cols, zero_cols);
    const int64_t chunks =
        std::clamp<int64_t>(kMaxZeroTiles / L.zero_col_tiles, 1, ceil_div(batch, 32));
    L.zero_rows = ceil_div(batch, chunks);
    L.zero_tiles = L.zero_col_tiles * ceil_div(batch, L.zero_rows);
    // The host cannot see where the plan (on the device) leaves gaps: one zero block per
    // 32 copy blocks at most, so that, gaps or none, at most about 3% of blocks are idle.
    // Without copy blocks, one per tile.
    const int64_t copy = L.plan.n_rows * ceil_div(batch, std::max<int64_t>(1, L.tile_rows));
    L.zero_blocks =
        copy == 0 ? L.zero_tiles : std::min(L.zero_tiles, std::max<int64_t>(1, copy / 32));
  }
  return L;
}

int64_t grid_blocks(const Launch& L) {
  const int64_t copy = L.plan.n_rows * ceil_div(L.batch, std::max<int64_t>(1, L.tile_rows));
  const int64_t blocks = L.zero_blocks + copy;
  TORCH_CHECK(
      blocks <= std::numeric_limits<int32_t>::max(), "kt_regroup: ", blocks,
      " thread blocks are more than one CUDA launch takes");
  return blocks;
}

// Calls launch(L, reads, writes, blocks) for each launch of a forward: per chunk of
// kMaxTensors outputs and, within it, of inputs (the first launch of a chunk fills its
// gaps with zeros).
template <typename Fn>
void forward_launches(
    const at::Tensor& plan,
    const TensorPtrs& inputs,
    const TensorPtrs& outs,
    int64_t batch,
    int64_t es,
    Fn launch) {
  for (size_t w_lo = 0; w_lo < outs.size(); w_lo += kMaxTensors) {
    const size_t w_n = std::min<size_t>(kMaxTensors, outs.size() - w_lo);
    int64_t cols = 0;
    for (size_t k = 0; k < w_n; ++k) cols += outs[w_lo + k]->size(1);
    if (cols == 0) continue;
    const auto w = table<kMaxTensors>(outs, w_lo, w_n, /*write=*/true);
    for (size_t r_lo = 0; r_lo < inputs.size(); r_lo += kMaxTensors) {
      const size_t r_n = std::min<size_t>(kMaxTensors, inputs.size() - r_lo);
      const Launch L = plan_launch(plan, batch, int64_t(inputs.size()), cols, es, r_lo == 0);
      const int64_t blocks = grid_blocks(L);
      if (blocks > 0) launch(L, table<kMaxTensors>(inputs, r_lo, r_n), w, blocks);
    }
  }
}

// The same for a backward: per chunk of kMaxTensors input gradients, each launch reading
// every gradient output (at most kMaxReads).
template <typename Fn>
void backward_launches(
    const at::Tensor& plan,
    const TensorPtrs& grads,
    const TensorPtrs& outs,
    int64_t batch,
    int64_t es,
    Fn launch) {
  TORCH_CHECK(grads.size() <= size_t(kMaxReads), "kt_regroup: more than ", kMaxReads, " gradients");
  const auto g = table<kMaxReads>(grads, 0, grads.size());
  for (size_t w_lo = 0; w_lo < outs.size(); w_lo += kMaxTensors) {
    const size_t w_n = std::min<size_t>(kMaxTensors, outs.size() - w_lo);
    int64_t cols = 0;
    for (size_t k = 0; k < w_n; ++k) cols += outs[w_lo + k]->size(1);
    if (cols == 0) continue;
    const Launch L = plan_launch(plan, batch, int64_t(grads.size()), cols, es, true);
    const int64_t blocks = grid_blocks(L);
    if (blocks > 0) launch(L, g, table<kMaxTensors>(outs, w_lo, w_n, /*write=*/true), blocks);
  }
}

// The kernels per dtype, in one place for permute.cu and tests/cuda_emulation.cpp:
// run(kernel) with the kernel (a pointer to a __global__ function of (Launch, reads,
// writes)) that a forward into `out_dtype` uses: the fused cast where it applies, else
// the byte copy of `es`-byte elements.
template <typename Run>
void with_forward_kernel(bool fused_cast, c10::ScalarType out_dtype, int64_t es, Run run) {
  if (fused_cast) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "kt_regroup_to", [&] {
      run(&permute_cast_kernel<scalar_t>);
    });
    return;
  }
  switch (es) {
    case 1:
      return run(&permute_copy_kernel<1>);
    case 2:
      return run(&permute_copy_kernel<2>);
    case 4:
      return run(&permute_copy_kernel<4>);
    case 8:
      return run(&permute_copy_kernel<8>);
    case 16:
      return run(&permute_copy_kernel<16>);
    default:
      TORCH_CHECK(false, "kt_regroup: no CUDA copy of ", es, "-byte elements");
  }
}

// The forward's host code, for permute.cu and tests/cuda_emulation.cpp alike: writes every
// column of `outs` (fresh, or the caller's for _into) through run(kernel, blocks, L,
// reads, writes), one call per launch; `plan_on(device)` gives the plan on the data's
// device, asked for only where something is launched. Inputs of another dtype than the
// outputs' are cast inside the copy where both are float (the fused cast), else first.
template <typename PlanOn, typename Run>
void forward_host(
    at::TensorList pooled_embs,
    at::TensorList outs,
    c10::ScalarType out_dtype,
    PlanOn plan_on,
    Run run) {
  const at::Tensor& first = pooled_embs[0];
  const int64_t batch = first.size(0);
  int64_t total_cols = 0;
  for (const at::Tensor& t : outs) total_cols += t.size(1);
  if (batch == 0 || total_cols == 0) return;
  const at::Tensor plan = plan_on(first.device());
  bool same = true, floats = is_float(out_dtype);
  for (const at::Tensor& t : pooled_embs) {
    same &= t.scalar_type() == out_dtype;
    floats &= is_float(t.scalar_type());
  }
  const bool fused_cast = !same && floats;
  std::vector<at::Tensor> inputs;
  for (const at::Tensor& t : pooled_embs) {
    at::Tensor x = t.resolve_conj().resolve_neg();
    inputs.push_back(fused_cast || x.scalar_type() == out_dtype ? x : x.to(out_dtype));
  }
  TensorPtrs in_ptrs, out_ptrs;
  for (const at::Tensor& t : inputs) in_ptrs.push_back(&t);
  for (const at::Tensor& t : outs) out_ptrs.push_back(&t);
  const int64_t es = outs[0].element_size();
  forward_launches(
      plan, in_ptrs, out_ptrs, batch, es,
      [&](const Launch& L, const auto& r, const auto& w, int64_t blocks) {
        with_forward_kernel(
            fused_cast, out_dtype, es, [&](auto kernel) { run(kernel, blocks, L, r, w); });
      });
}

// The same for a backward from float gradients of `grad_dtype` into `dtype`.
template <typename Run>
void with_backward_kernel(c10::ScalarType grad_dtype, c10::ScalarType dtype, Run run) {
  const bool wide = grad_dtype == at::kDouble || dtype == at::kDouble;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "kt_regroup_backward", [&] {
    // Only the pairs that occur: double input gradients always compute in double.
    using Narrow = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    if (wide) {
      run(&permute_backward_kernel<scalar_t, double>);
    } else {
      run(&permute_backward_kernel<scalar_t, Narrow>);
    }
  });
}

// ---- the variable-batch ops (permute_multi_embedding_vbe{,_backward}) -----------------

template <typename T>
int64_t as_field(const T* p) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

// Appends entry e (int64 fields) to a table.
template <typename S>
void append(std::vector<int64_t>& fields, const S& e) {
  static_assert(sizeof(S) % sizeof(int64_t) == 0, "int64 fields only");
  const size_t at = fields.size();
  fields.resize(at + sizeof(S) / sizeof(int64_t));
  std::memcpy(fields.data() + at, &e, sizeof(S));
}

bool has_index(const std::vector<std::optional<at::Tensor>>& indices, size_t i) {
  return i < indices.size() && indices[i].has_value() && indices[i]->defined();
}

// The VBE forward's launch (`outs`: batch rows; `inputs`: of the outputs' dtype):
// upload(fields) gives the table of inputs and outputs (std::vector<int64_t>) on the
// data's device, then run(kernel, blocks, L): one launch, whatever the number of inputs.
template <typename Upload, typename Run>
void vbe_forward_launches(
    const at::Tensor& plan,
    const std::vector<at::Tensor>& inputs,
    const std::vector<std::optional<at::Tensor>>& indices,
    const std::vector<at::Tensor>& outs,
    int64_t batch,
    Upload upload,
    Run run) {
  std::vector<int64_t> fields;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    VbeIn e{as_field(x.const_data_ptr()), x.stride(0), x.stride(1), x.size(1), x.size(0), 0, 0, 0};
    if (has_index(indices, i)) {
      const at::Tensor& idx = *indices[i];
      e.index = as_field(idx.const_data_ptr());
      e.index_stride = idx.stride(0);
      e.index_is64 = idx.scalar_type() == at::kLong;
    }
    append(fields, e);
  }
  int64_t total_cols = 0;
  for (const at::Tensor& t : outs) {
    append(fields, VbeOut{as_field(t.mutable_data_ptr()), t.stride(0), t.size(1), total_cols});
    total_cols += t.size(1);
  }
  const at::Tensor on_device = upload(fields);
  const int64_t* base = on_device.const_data_ptr<int64_t>();
  const int64_t es = outs[0].element_size();
  VbeLaunch L{};
  L.plan = device_plan(plan);
  L.ins = reinterpret_cast<const VbeIn*>(base);
  L.outs =
      reinterpret_cast<const VbeOut*>(base + inputs.size() * (sizeof(VbeIn) / sizeof(int64_t)));
  L.n_ins = static_cast<int64_t>(inputs.size());
  L.n_outs = static_cast<int64_t>(outs.size());
  L.batch = batch;
  L.total_cols = total_cols;
  // Copy blocks as the forward's (plan_launch); zero tiles as its zero blocks, taken by
  // one zero block per 32 copy blocks at most: where the plan leaves no gap (as a rule)
  // they write nothing. Without copy blocks, one zero block per tile.
  const Launch sizes =
      plan_launch(plan, batch, L.n_ins, total_cols, es, /*zero_fill=*/true, kZeroCols);
  L.tile_rows = std::min(sizes.tile_rows, kVbeTileRows);
  L.zero_col_tiles = sizes.zero_col_tiles;
  L.zero_rows = sizes.zero_rows;
  L.zero_tiles = sizes.zero_tiles;
  const int64_t copy = L.plan.n_rows * ceil_div(batch, std::max<int64_t>(1, L.tile_rows));
  L.zero_blocks =
      copy == 0 ? L.zero_tiles : std::min(L.zero_tiles, std::max<int64_t>(1, copy / 32));
  const int64_t blocks = L.zero_blocks + copy;
  TORCH_CHECK(
      blocks <= std::numeric_limits<int32_t>::max(), "kt_regroup: ", blocks,
      " thread blocks are more than one CUDA launch takes");
  if (blocks == 0) return;
  switch (es) {
    case 1:
      return run(&vbe_copy_kernel<1>, blocks, L);
    case 2:
      return run(&vbe_copy_kernel<2>, blocks, L);
    case 4:
      return run(&vbe_copy_kernel<4>, blocks, L);
    case 8:
      return run(&vbe_copy_kernel<8>, blocks, L);
    case 16:
      return run(&vbe_copy_kernel<16>, blocks, L);
    default:
      TORCH_CHECK(false, "kt_regroup: no CUDA copy of ", es, "-byte elements");
  }
}

// Bytes of a row that one VBE backward block covers (with the samples it reads).
constexpr int64_t kVbeColBytes = 1024;

// The VBE backward's launches into `flat` (the input gradients of in_rows x in_lengths
// side by side, as the op returns them; float dtypes, gradients of its dtype, at most
// kMaxReads, some defined). upload(fields) as for the forward; run(kernel, blocks, args...)
// per launch. Where some input has an index: the keys of its samples (vbe_keys_kernel),
// one stable sort of them and a search of each key's first sample (ATen ops on the
// device, no host sync); then vbe_backward_kernel. Four launches whatever the number of
// inputs.
template <typename Upload, typename Run>
void vbe_backward_launches(
    const at::Tensor& plan,
    const TensorPtrs& grads,
    const std::vector<std::optional<at::Tensor>>& indices,
    c10::IntArrayRef in_rows,
    c10::IntArrayRef in_lengths,
    int64_t batch,
    const at::Tensor& flat,
    Upload upload,
    Run run) {
  const int64_t n_in = static_cast<int64_t>(in_rows.size()), es = flat.element_size();
  char* const data = static_cast<char*>(flat.mutable_data_ptr());
  std::vector<int64_t> fields;
  std::vector<VbeIndex> indexed;
  int64_t offset = 0, blocks = 0, n_keys = 0;
  for (int64_t i = 0; i < n_in; ++i) {
    const int64_t rows = in_rows[i], width = in_lengths[i];
    VbeGrad g{as_field(data + offset * es), width, rows, blocks, 1, 1, 1, -1, 0};
    offset += rows * width;
    if (has_index(indices, size_t(i))) {
      const at::Tensor& idx = *indices[i];
      g.key_base = n_keys;
      g.slot_base = static_cast<int64_t>(indexed.size()) * batch;
      indexed.push_back(VbeIndex{
          as_field(idx.const_data_ptr()), idx.stride(0), idx.scalar_type() == at::kLong, rows,
          n_keys, i});
      n_keys += rows;
    }
    if (rows > 0 && width > 0) {
      // Tiles of about kTileBytes of gradient read and written: a row reads its samples.
      g.col_tile = std::min(width, std::max<int64_t>(32, kVbeColBytes / es));
      g.col_tiles = ceil_div(width, g.col_tile);
      const int64_t samples = g.key_base >= 0 ? ceil_div(batch, rows) : 1;
      g.row_tile = std::clamp<int64_t>(kTileBytes / (g.col_tile * es * (1 + samples)), 1, rows);
      blocks += ceil_div(rows, g.row_tile) * g.col_tiles;
    }
    append(fields, g);
  }
  TORCH_CHECK(
      blocks <= std::numeric_limits<int32_t>::max(), "kt_regroup: ", blocks,
      " thread blocks are more than one CUDA launch takes");
  for (const VbeIndex& x : indexed) append(fields, x);
  const at::Tensor on_device = upload(fields);
  const int64_t* base = on_device.const_data_ptr<int64_t>();
  VbeBackLaunch L{};
  L.plan = device_plan(plan);
  L.ins = reinterpret_cast<const VbeGrad*>(base);
  L.n_ins = n_in;
  at::Tensor starts, order;
  const int64_t slots = static_cast<int64_t>(indexed.size()) * batch;
  if (slots > 0) {
    const bool wide = n_keys >= std::numeric_limits<int32_t>::max();
    const auto options = flat.options().dtype(wide ? at::kLong : at::kInt);
    const at::Tensor keys = at::empty({slots}, options), bounds = at::empty({n_keys + 1}, options);
    VbeKeys K{
        reinterpret_cast<const VbeIndex*>(base + n_in * int64_t(sizeof(VbeGrad) / sizeof(int64_t))),
        static_cast<int64_t>(indexed.size()),
        batch,
        n_keys,
        keys.mutable_data_ptr(),
        bounds.mutable_data_ptr()};
    const int64_t key_blocks = ceil_div(std::max(slots, n_keys + 1), kThreads);
    TORCH_CHECK(
        key_blocks <= std::numeric_limits<int32_t>::max(), "kt_regroup: ", key_blocks,
        " thread blocks are more than one CUDA launch takes");
    run(wide ? &vbe_keys_kernel<int64_t> : &vbe_keys_kernel<int32_t>, key_blocks, K);
    at::Tensor sorted;
    std::tie(sorted, order) = at::sort(keys, /*stable=*/true, 0, /*descending=*/false);
    starts = at::searchsorted(sorted, bounds);
    L.starts = starts.const_data_ptr<int64_t>();
    L.order = order.const_data_ptr<int64_t>();
  }
  if (blocks == 0) return;
  const auto g = table<kMaxReads>(grads, 0, grads.size());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, flat.scalar_type(), "kt_regroup_vbe_backward",
      [&] { run(&vbe_backward_kernel<scalar_t>, blocks, L, g); });
}

}  // namespace
}  // namespace cuda
}  // namespace kt_regroup
