// Declarations shared by kt_regroup's C++ files.
//
// ops.cpp      every schema (TORCH_LIBRARY) but the private diagnostic ops', the plan ops
//              kt_regroup_arguments and regroup_keyed_tensor, the dense ops' argument
//              checks (check), build info
// portable.cpp kernels made of ATen copies, for every device (CompositeExplicitAutograd)
// cpu.cpp      the native CPU kernels
// machine_code.h/.cpp  the CPU copy programs as x86-64 machine code
// cpu_memory.h/.cpp  the CPU kernels' large outputs: a bounded cache of freed blocks
// autograd.cpp the autograd kernels (the only autograd when this library is loaded)
// vbe.cpp      the variable-batch ops (permute_multi_embedding_vbe and its backward):
//              their checks (check(VbeCall)), CPU and portable kernels, autograd
// cuda/        the CUDA kernels (kernels.cuh) and their host code and registration
//              (permute.cu), built when the CUDA toolkit is found
// The private diagnostic ops (_cpu_memory, _cpu_copy_program, _cpu_machine_code) are
// defined, schemas included, beside what they report, in cpu_memory.cpp and
// machine_code.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
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
// The tensors of a Tensor?[] argument, held while TensorPtrs point to them.
using HeldTensors = PerTensor<std::optional<at::Tensor>>;

// A floating dtype the kernels compute in (accumulation, fused casts).
inline bool is_float(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
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

// The dispatcher's handle of the op `name` ("kt_regroup::..."), for a static at the caller.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The tensors of a Tensor[] argument as pointers.
inline TensorPtrs pointers(at::TensorList tensors) {
  TensorPtrs out;
  for (const at::Tensor& t : tensors) out.push_back(&t);
  return out;
}

// The plan arguments of every op: the permute rows, the widths they declare, and the
// widths the call gives (out_lengths for a forward, in_lengths for a backward; the _into
// op's come from its outputs).
struct PlanArgs {
  const at::Tensor& permutes;
  const at::Tensor& in_shapes;
  const at::Tensor& out_shapes;
  c10::IntArrayRef lengths = {};

  // The plan is where the host reads it without waiting for a device.
  bool on_host() const { return permutes.is_cpu() && in_shapes.is_cpu() && out_shapes.is_cpu(); }
};

// What a call's tensors are, for check().
enum class Kind : uint8_t {
  kForward,   // permute_multi_embedding{,_to}: inputs of one dtype and one batch size
  kCast,      // permute_multi_embedding_to with a dtype: inputs of any dtypes (each cast)
  kInto,      // permute_multi_embedding_into: `outs` are the caller's outputs
  kVbe,       // the variable-batch forward's plan: inputs of their own row counts
  kBackward,  // the backward ops: upstream gradients (nullptr: None) and a batch size
};

struct Call {
  const char* op;
  Kind kind;
  TensorPtrs tensors;        // the inputs, or the upstream gradients
  int64_t batch_size = 0;    // kBackward
  at::TensorList outs = {};  // kInto
  // The kernel reads the plan on its device (CUDA): where the plan is there, only the
  // checks that read no data run (no host sync) and no plan is returned.
  bool device_kernel = false;
};

// A plan that passed check(): its segments, whether they write every output column
// exactly once (segments_tile_outputs), the outputs' widths, and slots where a kernel
// keeps what it compiles from the segments (the CPU kernel's copy programs). Written only
// by the thread that got the plan: the plan cache is per thread.
struct CheckedPlan {
  std::vector<Segment> segments;
  bool tiled = false;
  std::vector<int64_t> out_widths;
  // The forward's, by log2 of the element size (1 to 16 bytes).
  mutable std::shared_ptr<const void> compiled[5];
  // The backward's (the CPU kernel's, by dtypes and gradient strides).
  mutable std::shared_ptr<void> backward;
};

// The argument checks of the dense ops (ops.cpp), the one entry point of every kernel:
// nothing is read or written by a kernel before it returns. Checks the tensors (dense,
// 2-D, one device, dtypes, batch sizes), the caller's outputs (kInto: shapes, strides, no
// overlap), the metadata's shapes and dtypes, the sizes, and, where the plan is read on
// the host, the plan's values: declared widths against the tensors, every permute row
// inside its tensors. Returns the rows as segments, adjacent contiguous rows merged and
// empty rows dropped; nullptr for a device kernel whose plan is on its device.
//
// Remembered per thread (both directions share one cache): a call whose metadata
// tensors are contiguous CPU tensors holding the same values as a checked call's, with
// the same widths, runs only the checks that read no plan values and gets that call's
// plan. The values are compared in full (no identity, version or pointer is trusted), so
// the guarantee holds whatever the caller modified in between. kVbe is not cached.
std::shared_ptr<const CheckedPlan> check(const Call& call, const PlanArgs& plan);

// A variable-batch call for check() (vbe.cpp): the forward's inputs, or the backward's
// gradients (nullptr: None) with the inputs' row counts and dtype.
struct VbeCall {
  bool backward;
  TensorPtrs tensors;
  const c10::List<std::optional<at::Tensor>>& indices;
  c10::IntArrayRef in_rows = {};       // backward
  c10::ScalarType dtype = at::kFloat;  // backward
  // As Call's; the indices' values are then checked by the kernels (reading them here
  // would wait for the device).
  bool device_kernel = false;
};

struct VbeChecked {
  std::shared_ptr<const CheckedPlan> plan;  // nullptr as check()'s
  std::vector<std::optional<at::Tensor>> indices;
  int64_t batch;
};

// The variable-batch ops' checks: check()'s for the plan, then the indices (1-D,
// int32/int64, the data's device, one length: the batch; and every value inside its
// input where the host reads them) and the sizes.
VbeChecked check(const VbeCall& call, const PlanArgs& plan);

// A dense (strided, not quantized, not nested) tensor, or a TypeError naming `name[i]`
// (`name` alone for i < 0).
void check_dense(const char* op, const char* name, int64_t i, const at::Tensor& t);

// `batch` rows of each of `lengths` fit in int64 bytes (a 16-byte dtype), or a ValueError
// naming `name[j]`: checked before any output is allocated.
void check_output_elements(
    const char* op, const char* name, c10::IntArrayRef lengths, int64_t batch);

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
    const c10::List<std::optional<at::Tensor>>& grad_outputs, HeldTensors& held);

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
