// Declarations shared by kt_regroup's C++ files.
//
// ops.cpp      the main ops' schemas (TORCH_LIBRARY), the plan ops kt_regroup_arguments and
//              regroup_keyed_tensor, argument checks, build info
// portable.cpp kernels made of ATen copies, for every device (CompositeExplicitAutograd)
// cpu.cpp      the native CPU kernels
// machine_code.h/.cpp  the CPU copy programs as x86-64 machine code
// cpu_memory.h/.cpp  the CPU kernels' large outputs: a bounded cache of freed blocks
// autograd.cpp the autograd kernels (the only autograd when this library is loaded)
// vbe.cpp      the variable-batch ops (permute_multi_embedding_vbe and its backward):
//              schemas, checks, CPU and portable kernels, autograd
// cuda/        the CUDA kernels (kernels.cuh) and their host code and registration
//              (permute.cu), built when the CUDA toolkit is found
// The private diagnostic ops (_cpu_memory, _cpu_copy_program, _cpu_machine_code) are
// defined beside what they report, in cpu_memory.cpp and machine_code.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <optional>
#include <vector>

namespace kt_regroup {

// [in_tensor, out_tensor, in_offset, out_offset, length, next]
constexpr int64_t kPermuteColumns = 6;

// The CPU kernels hand work to threads in chunks of at least this many bytes: ATen's own
// grain for copies (at::internal::GRAIN_SIZE, 32768 float32 elements), so a regroup runs
// on as many threads as a clone of its outputs does (docs/cpu_kernel.md).
constexpr int64_t kGrainBytes = 128 * 1024;

// One copy: out[out_t][:, out_off:out_off+length] = in[in_t][:, in_off:in_off+length].
struct Segment {
  int64_t in_t;
  int64_t out_t;
  int64_t in_off;
  int64_t out_off;
  int64_t length;
};

// One value per tensor of a call (widths, strides, pointers): up to 8 without a heap
// allocation, so the per-call checks of a serving request allocate nothing.
template <typename T>
using PerTensor = c10::SmallVector<T, 8>;
// Tensors of a Tensor[] / Tensor?[] argument; nullptr stands for None.
using TensorPtrs = PerTensor<const at::Tensor*>;

// A floating dtype the kernels compute in (accumulation, fused casts).
inline bool is_float(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The plan where the host reads it without waiting for a device.
inline bool on_host(
    const at::Tensor& permutes, const at::Tensor& in_shapes, const at::Tensor& out_shapes) {
  return permutes.is_cpu() && in_shapes.is_cpu() && out_shapes.is_cpu();
}

// `t` with its lazy conjugate and negative bits resolved (the kernels copy bytes).
inline at::Tensor resolve_lazy(const at::Tensor& t) {
  at::Tensor r = t.is_conj() ? t.resolve_conj() : t;
  return r.is_neg() ? r.resolve_neg() : r;
}

// The device of a backward's input gradients: that of the first gradient given (the
// checks put all on one device), else the plan's.
inline c10::Device gradients_device(const TensorPtrs& grads, const at::Tensor& permutes) {
  for (const at::Tensor* g : grads) {
    if (g) return g->device();
  }
  return permutes.device();
}

// A dense (strided, not quantized, not nested) tensor, or a TypeError naming `name[i]`
// (`name` alone for i < 0).
void check_dense(const char* op, const char* name, int64_t i, const at::Tensor& t);

// `batch` rows of each of `lengths` fit in int64 bytes (a 16-byte dtype), or a ValueError
// naming `name[j]`: checked before any output is allocated.
void check_output_elements(
    const char* op, const char* name, c10::IntArrayRef lengths, int64_t batch);

// The checks of a call that read no tensor data (dims, dtypes, devices, batch sizes, the
// metadata's shapes and dtypes, negative sizes): what a kernel whose plan is on a device
// runs without a host sync (the CUDA kernels).
//   forward:  ptrs = pooled_embs, lengths = out_lengths, batch_size = nullopt
//   backward: ptrs = grad_outputs, lengths = in_lengths, batch_size given
// `same_batch`: the tensors share one row count (false: the variable-batch op's inputs).
void check_without_data(
    const char* op,
    const TensorPtrs& ptrs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef lengths,
    std::optional<int64_t> batch_size,
    bool same_dtype,
    bool same_batch = true);

// Checks a forward call (inputs, metadata, widths, every permute row) and returns its
// rows as segments, adjacent contiguous rows merged and empty rows dropped. Nothing is
// read or written by a kernel before this returns. `same_dtype`: all inputs share one
// dtype (false only for the fused cast, which casts each input).
std::vector<Segment> check_forward(
    const char* op,
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    bool same_dtype = true);

// A plan that passed check_forward or check_backward: its segments, whether they write
// every output column exactly once (segments_tile_outputs), the outputs' widths, and
// slots where a kernel keeps what it compiles from the segments (the CPU kernel's copy
// programs). Written only by the thread that got the plan: the plan cache is per thread.
struct CheckedPlan {
  std::vector<Segment> segments;
  bool tiled = false;
  std::vector<int64_t> out_widths;
  // The forward's, by log2 of the element size (1 to 16 bytes).
  mutable std::shared_ptr<const void> compiled[5];
  // The backward's (the CPU kernel's, by dtypes and gradient strides).
  mutable std::shared_ptr<void> backward;
};

// check_forward, remembered per thread: a call whose metadata tensors are contiguous CPU
// tensors holding the same values as a checked call's, with the same widths, runs only
// the checks that read no data (dims, devices, dtypes, batch sizes, metadata shapes) and
// gets that call's plan. The values are compared in full (no identity, version or
// pointer is trusted), so the guarantee holds whatever the caller modified in between.
std::shared_ptr<const CheckedPlan> check_forward_plan(
    const char* op,
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    bool same_dtype = true);

// The same for a backward call; `grads` may hold nullptr (None: zeros). Through the same
// per-thread cache as check_forward_plan (a plan checked by either serves both).
std::shared_ptr<const CheckedPlan> check_backward_plan(
    const char* op,
    const TensorPtrs& grads,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    int64_t batch_size);

// check_backward_plan's segments.
std::vector<Segment> check_backward(
    const char* op,
    const TensorPtrs& grads,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    int64_t batch_size);

// The caller-owned outputs of a permute_multi_embedding_into call (2-D, batch, dtype,
// device, unit column stride, rows that share no memory, no overlap by address with the
// inputs or each other whatever their Storage, no inference tensor outside inference
// mode); reads no tensor data. Returns their widths (the call's out_lengths).
PerTensor<int64_t> check_into_outs(at::TensorList pooled_embs, at::TensorList outs);

// check_into_outs, then everything check_forward checks. Zeroes the outputs unless the
// segments write every column; the kernel then copies the returned segments.
std::vector<Segment> prepare_into(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs);

// prepare_into, returning the checked plan (check_forward_plan).
std::shared_ptr<const CheckedPlan> prepare_into_plan(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs);

// Whether the segments write every column of every output exactly once, in order
// (then outputs need no zero fill).
bool segments_tile_outputs(const std::vector<Segment>& segments, c10::IntArrayRef out_lengths);

// The backward by ATen ops: zeros, then += per segment in row order; float16/bfloat16
// accumulate in float32 and round once. The portable kernel, and the CPU kernel's path
// for gradient dtypes its fast path does not cover.
std::vector<at::Tensor> backward_by_segments(
    const TensorPtrs& grads,
    const std::vector<Segment>& segments,
    c10::IntArrayRef in_lengths,
    int64_t batch_size,
    c10::ScalarType dtype,
    c10::Device device);

// `grad_outputs` of the backward op as pointers (nullptr for None / undefined); `held`
// keeps the tensors alive.
TensorPtrs grad_pointers(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    std::vector<std::optional<at::Tensor>>& held);

// check_forward for inputs whose row counts differ (the variable-batch op, vbe.cpp):
// everything check_forward checks except one batch size for all inputs.
std::vector<Segment> check_forward_rows(
    const char* op,
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths);

// vbe.cpp, for the variable-batch ops' CUDA kernels (cuda/permute.cu): their checks,
// returning the batch size. Everything the CPU kernels check where the plan (permutes,
// in_shapes, out_shapes) is on the CPU, else what reads no data (check_without_data);
// the indices' values never (that would wait for the device: the kernels check them).
int64_t check_vbe_forward_on_device(
    at::TensorList pooled_embs,
    const c10::List<std::optional<at::Tensor>>& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths);
int64_t check_vbe_backward_on_device(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const c10::List<std::optional<at::Tensor>>& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    c10::IntArrayRef in_rows,
    c10::ScalarType dtype);

// The variable-batch backward by ATen ops (index_add_; vbe.cpp): every device without a
// kernel of its own, and the dtypes the CUDA kernel does not take.
at::Tensor vbe_backward_portable(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const c10::List<std::optional<at::Tensor>>& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    c10::IntArrayRef in_rows,
    c10::ScalarType dtype);

}  // namespace kt_regroup
