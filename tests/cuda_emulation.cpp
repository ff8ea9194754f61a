// Runs the device code of kt_regroup/csrc/cuda (kernels.cuh) on the CPU: each thread
// block as kThreads std::threads with a std::barrier for __syncthreads, blocks one after
// another, so __shared__ arrays can be statics. The launches are planned, and the kernel
// per dtype chosen, by the same host code as in permute.cu (forward_host, forward_launches /
// backward_launches, with_forward_kernel / with_backward_kernel, vbe_forward_launches /
// vbe_backward_launches); what this file adds is
// the emulation and the outputs' allocation, which (unlike permute.cu) fills them with a
// marker so that an element no kernel writes shows. Built and driven by
// tests/test_cuda_kernel.py; machines without a GPU test the kernels' logic here.

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct EmulatedIndex {
  unsigned x = 0;
};
thread_local EmulatedIndex threadIdx, blockIdx;
struct uint4 {
  unsigned x, y, z, w;
};

namespace emulation {
inline std::barrier<>* barrier = nullptr;
inline std::atomic<int> flag[2];
thread_local int generation = 0;
}  // namespace emulation

inline void __syncthreads() {
  emulation::barrier->arrive_and_wait();
}

// A device-side assert of an index (KT_REGROUP_INDEX_ASSERT): the first message, raised
// as IndexError once the launch is done (the kernel goes on, as after a failed assert).
namespace emulation {
inline std::mutex failed_mutex;
inline std::string failed;
template <typename... Args>
void fail(const char* format, Args... args) {
  char message[512];
  std::snprintf(message, sizeof(message), format, args...);
  const std::lock_guard<std::mutex> lock(failed_mutex);
  if (failed.empty()) failed = message;
}
}  // namespace emulation
#define KT_REGROUP_INDEX_ASSERT(cond, fmt, ...)     \
  do {                                              \
    if (!(cond)) emulation::fail(fmt, __VA_ARGS__); \
  } while (0)

inline int __syncthreads_or(int predicate) {
  const int g = emulation::generation++ & 1;
  if (predicate) emulation::flag[g].store(1);
  emulation::barrier->arrive_and_wait();
  const int any = emulation::flag[g].load();
  emulation::barrier->arrive_and_wait();
  if (threadIdx.x == 0) emulation::flag[g].store(0);
  return any;
}

#include "kernels.cuh"

#include <torch/extension.h>

namespace kt_regroup::cuda {
namespace {

template <typename Kernel, typename... Args>
void emulate(Kernel kernel, int64_t blocks, const Args&... args) {
  for (int64_t b = 0; b < blocks; ++b) {
    std::barrier<> barrier(kThreads);
    emulation::barrier = &barrier;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        blockIdx.x = static_cast<unsigned>(b);
        threadIdx.x = static_cast<unsigned>(t);
        kernel(args...);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  std::string failed;
  std::swap(failed, emulation::failed);
  if (!failed.empty()) throw std::out_of_range(failed);
}

// The launcher of the shared host code (vbe_forward_launches, vbe_backward_launches).
const auto emulated = [](auto kernel, int64_t blocks, const auto&... args) {
  emulate(kernel, blocks, args...);
};

// Outputs filled with a marker (NaN, or -77) that no correct kernel leaves behind.
at::Tensor marked(int64_t batch, int64_t width, c10::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  if (dtype == at::kBool) return at::ones({batch, width}, options);
  if (at::isFloatingType(dtype) || at::isComplexType(dtype)) {
    return at::full({batch, width}, std::numeric_limits<double>::quiet_NaN(), options);
  }
  return at::full({batch, width}, -77, options);
}

// permute.cu's launch_forward(), emulated: the same host code (forward_host).
void into(
    const std::vector<at::Tensor>& pooled_embs,
    const at::Tensor& plan,
    const std::vector<at::Tensor>& outs) {
  if (outs.empty()) return;
  forward_host(
      pooled_embs, outs, outs[0].scalar_type(), [&](c10::Device) { return plan; }, emulated);
}

// permute.cu's forward() without its argument checks and CUDA runtime calls.
std::vector<at::Tensor> forward(
    const std::vector<at::Tensor>& pooled_embs,
    const at::Tensor& plan,
    const std::vector<int64_t>& out_lengths,
    std::optional<c10::ScalarType> dtype) {
  const at::Tensor& first = pooled_embs[0];
  std::vector<at::Tensor> outs;
  for (int64_t n : out_lengths)
    outs.push_back(marked(first.size(0), n, dtype.value_or(first.scalar_type())));
  into(pooled_embs, plan, outs);
  return outs;
}

// permute.cu's backward without its checks: float gradients, at least one defined.
std::vector<at::Tensor> backward(
    const std::vector<std::optional<at::Tensor>>& grad_outputs,
    const at::Tensor& plan,
    const std::vector<int64_t>& in_lengths,
    int64_t batch,
    c10::ScalarType dtype) {
  TensorPtrs grads;
  c10::ScalarType grad_dtype = dtype;
  for (const auto& g : grad_outputs) {
    grads.push_back(g.has_value() ? &*g : nullptr);
    if (g.has_value()) grad_dtype = g->scalar_type();
  }
  std::vector<at::Tensor> outs;
  for (int64_t n : in_lengths) outs.push_back(marked(batch, n, dtype));
  if (batch == 0) return outs;
  TensorPtrs out_ptrs;
  for (const at::Tensor& t : outs) out_ptrs.push_back(&t);
  backward_launches(
      plan, grads, out_ptrs, batch, outs[0].element_size(),
      [&](const Launch& L, const auto& g, const auto& w, int64_t blocks) {
        with_backward_kernel(
            grad_dtype, dtype, [&](auto kernel) { emulate(kernel, blocks, L, g, w); });
      });
  return outs;
}

// permute.cu's permute_multi_embedding_vbe_cuda without its checks.
std::vector<at::Tensor> vbe_forward(
    const std::vector<at::Tensor>& pooled_embs,
    const std::vector<std::optional<at::Tensor>>& indices,
    const at::Tensor& plan,
    const std::vector<int64_t>& out_lengths,
    int64_t batch) {
  std::vector<at::Tensor> outs;
  for (int64_t n : out_lengths) outs.push_back(marked(batch, n, pooled_embs[0].scalar_type()));
  if (batch == 0 || outs.empty()) return outs;
  std::vector<at::Tensor> inputs;
  for (const at::Tensor& t : pooled_embs) inputs.push_back(t.resolve_conj().resolve_neg());
  vbe_forward_launches(plan, inputs, indices, outs, batch, emulated);
  return outs;
}

// permute.cu's permute_multi_embedding_vbe_backward_cuda without its checks: float
// gradients of `dtype`; the flat result starts as NaN.
at::Tensor vbe_backward(
    const std::vector<std::optional<at::Tensor>>& grad_outputs,
    const std::vector<std::optional<at::Tensor>>& indices,
    const at::Tensor& plan,
    const std::vector<int64_t>& in_lengths,
    const std::vector<int64_t>& in_rows,
    int64_t batch,
    c10::ScalarType dtype) {
  TensorPtrs grads;
  bool defined = false;
  for (const auto& g : grad_outputs) {
    grads.push_back(g.has_value() ? &*g : nullptr);
    defined |= g.has_value();
  }
  int64_t total = 0;
  for (size_t i = 0; i < in_rows.size(); ++i) total += in_rows[i] * in_lengths[i];
  if (!defined) return at::zeros({total}, at::TensorOptions().dtype(dtype));
  at::Tensor flat = marked(1, total, dtype).view({total});
  if (total > 0)
    vbe_backward_launches(plan, grads, indices, in_rows, in_lengths, batch, flat, emulated);
  return flat;
}

}  // namespace
}  // namespace kt_regroup::cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &kt_regroup::cuda::forward);
  m.def("into", &kt_regroup::cuda::into);
  m.def("backward", &kt_regroup::cuda::backward);
  m.def("vbe_forward", &kt_regroup::cuda::vbe_forward);
  m.def("vbe_backward", &kt_regroup::cuda::vbe_backward);
  m.attr("max_tensors") = kt_regroup::cuda::kMaxTensors;
}
