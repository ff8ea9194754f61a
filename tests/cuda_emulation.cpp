// Runs the device code of kt_regroup/csrc/cuda (kernels.cuh) on the CPU the way a device
// may: blocks one at a time in a seeded random order (set_block_order), each as kThreads
// fibers that run in turn between its barriers, in a seeded random order; shared memory
// poisoned (0xFF bytes) before each block, misaligned 16-byte accesses trapped, and each
// launch checked against the device's limits (grid, block, parameter bytes, static shared
// memory). The launches are planned, and the kernel per dtype chosen, by the same host
// code as in permute.cu (forward_host, forward_launches / backward_launches,
// with_forward_kernel / with_backward_kernel, vbe_forward_launches /
// vbe_backward_launches); what this file adds is the emulation and the outputs'
// allocation, which (unlike permute.cu) fills them with a marker so that an element no
// kernel writes shows. Built and driven by tests/test_cuda_kernel.py; machines without a
// GPU test the kernels' logic here.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
// Every __shared__ variable in one section, so that a block's shared memory can be
// poisoned and its footprint measured (__start_/__stop_ symbols of the linker).
#define __shared__ static __attribute__((section("kt_emu_shared")))
extern "C" char __start_kt_emu_shared[], __stop_kt_emu_shared[];

struct EmulatedIndex {
  unsigned x = 0;
};
thread_local EmulatedIndex threadIdx, blockIdx;
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>(((uint64_t(hi) << 32) | lo) >> (shift & 31));
}

namespace emulation {
// What a launch did wrong (a misaligned access, an index assert): the first message of
// each kind, raised once the launch is done (the kernel goes on, as after a failed assert).
inline std::mutex failed_mutex;
inline std::string failed, fault;
inline void record(std::string& slot, const char* message) {
  const std::lock_guard<std::mutex> lock(failed_mutex);
  if (slot.empty()) slot = message;
}
template <typename... Args>
void fail(const char* format, Args... args) {
  char message[512];
  std::snprintf(message, sizeof(message), format, args...);
  record(failed, message);
}

// A 16-byte access: trapped where the address is not 16-byte aligned (a device faults);
// done byte-wise then, so that the host does not fault first.
inline bool aligned16(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return true;
  char message[160];
  std::snprintf(
      message, sizeof(message), "misaligned 16-byte %s at %p (block %u, thread %u)", what, p,
      blockIdx.x, threadIdx.x);
  record(fault, message);
  return false;
}
}  // namespace emulation

// The cost model (trace_begin / trace_end): each global access a block makes, keyed by
// the warp instruction it belongs to (warp, call site, tile, step, and its number among
// the lane's accesses at that site in that step), merged per block into sectors.
namespace emulation {
struct Access {
  uint32_t warp, site, tile, step, seq;
  uintptr_t addr;
  uint32_t size;
};
struct Lane {
  uint32_t tile = 0, step = 0;
  uint32_t seq[4096] = {};
  std::vector<uint32_t> sites;  // seq entries to reset at the next step
  std::vector<Access> log;
  int64_t plan_bytes = 0;
  void reset() {
    tile = step = 0;
    for (uint32_t site : sites) seq[site] = 0;
    sites.clear();
    log.clear();
    plan_bytes = 0;
  }
};
inline bool tracing = false;
inline Lane lanes[256];  // kThreads (checked below)

inline void next_step(Lane& l) {
  for (uint32_t site : l.sites) l.seq[site] = 0;
  l.sites.clear();
}

inline void record(uint32_t site, const void* p, uint32_t size) {
  Lane& l = lanes[threadIdx.x];
  const uint32_t s = site % 4096;
  if (l.seq[s] == 0) l.sites.push_back(s);
  l.log.push_back(Access{
      threadIdx.x / 32, site, l.tile, l.step, l.seq[s]++, reinterpret_cast<uintptr_t>(p), size});
}
}  // namespace emulation

#define KT_REGROUP_MEMORY_HOOKS
template <int kSite, typename T>
T ld(const T* p) {
  if (emulation::tracing) emulation::record(kSite, p, sizeof(T));
  if (sizeof(T) != 16 || emulation::aligned16(p, "load")) return *p;
  T v;
  std::memcpy(&v, p, 16);
  return v;
}
template <int kSite, typename T>
void st(T* p, const T& v) {
  if (emulation::tracing) emulation::record(kSite, p, sizeof(T));
  if (sizeof(T) != 16 || emulation::aligned16(p, "store")) {
    *p = v;
  } else {
    std::memcpy(p, &v, 16);
  }
}
template <typename T>
T ld_plan(const T* p) {
  if (emulation::tracing) emulation::lanes[threadIdx.x].plan_bytes += sizeof(T);
  return *p;
}
inline void tile_begins() {
  emulation::Lane& l = emulation::lanes[threadIdx.x];
  ++l.tile;
  l.step = 0;
  emulation::next_step(l);
}
inline void tile_step() {
  emulation::Lane& l = emulation::lanes[threadIdx.x];
  ++l.step;
  emulation::next_step(l);
}

namespace kt_regroup::cuda {
namespace {
int block_sync(int predicate);  // BlockPool::sync of the running block
}
}  // namespace kt_regroup::cuda

inline void __syncthreads() {
  kt_regroup::cuda::block_sync(0);
}

#define KT_REGROUP_INDEX_ASSERT(cond, fmt, ...)     \
  do {                                              \
    if (!(cond)) emulation::fail(fmt, __VA_ARGS__); \
  } while (0)

inline int __syncthreads_or(int predicate) {
  return kt_regroup::cuda::block_sync(predicate != 0);
}

#include "kernels.cuh"

#include <torch/extension.h>

static_assert(std::size(emulation::lanes) == kt_regroup::cuda::kThreads);

namespace kt_regroup::cuda {
namespace {

// The device's limits on a launch (compute capability 9.0): grid.x, threads per block,
// kernel parameters without the CUDA 12.1 opt-in, static shared memory.
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;
constexpr int kMaxBlockThreads = 1024;
constexpr size_t kMaxParamBytes = 4096;
constexpr size_t kMaxStaticShared = 48 * 1024;

// Runs one block at a time as kThreads fibers (ucontext) on the calling thread: each runs
// until its next __syncthreads or its end, then the next one; a barrier is passed once
// every fiber that has not ended has reached it. In each phase the fibers run in a random
// order drawn from the launch's block order (index order for seed < 0): a block's threads
// interleave in any order on a device. One OS thread instead of kThreads threads that
// meet at a std::barrier: no context switch through the kernel per thread and barrier.
class BlockPool {
 public:
  static constexpr size_t kStack = size_t(256) << 10;

  BlockPool() {
    void* stacks = mmap(
        nullptr, kStack * kThreads, PROT_READ | PROT_WRITE,
        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) throw std::runtime_error("emulation: no memory for the fibers");
    stacks_ = static_cast<char*>(stacks);
  }
  ~BlockPool() { munmap(stacks_, kStack * kThreads); }

  void run(int64_t block, const std::function<void()>& job, std::mt19937_64* rng) {
    job_ = &job;
    blockIdx.x = static_cast<unsigned>(block);
    for (int t = 0; t < kThreads; ++t) {
      ucontext_t& c = fibers_[t];
      getcontext(&c);
      c.uc_stack.ss_sp = stacks_ + t * kStack;
      c.uc_stack.ss_size = kStack;
      c.uc_link = &scheduler_;
      makecontext(&c, &BlockPool::fiber, 0);
      ended_[t] = false;
    }
    std::iota(order_.begin(), order_.end(), 0);
    for (int live = kThreads; live > 0;) {
      if (rng) std::shuffle(order_.begin(), order_.end(), *rng);
      for (const int t : order_) {
        if (ended_[t]) continue;
        current_ = t;
        threadIdx.x = static_cast<unsigned>(t);
        swapcontext(&scheduler_, &fibers_[t]);
        live -= ended_[t];
      }
      any_ = any_next_;  // what __syncthreads_or returns after this barrier
      any_next_ = 0;
    }
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // __syncthreads (and __syncthreads_or's predicate): back to the scheduler.
  int sync(int predicate) {
    any_next_ |= predicate;
    swapcontext(&fibers_[current_], &scheduler_);
    return any_;
  }

 private:
  static void fiber();

  char* stacks_ = nullptr;
  ucontext_t scheduler_{};
  ucontext_t fibers_[kThreads]{};
  bool ended_[kThreads]{};
  std::array<int, kThreads> order_{};
  const std::function<void()>* job_ = nullptr;
  int current_ = 0, any_ = 0, any_next_ = 0;
  std::exception_ptr error_;
};

BlockPool& pool() {
  static BlockPool p;
  return p;
}

int block_sync(int predicate) {
  return pool().sync(predicate);
}

void BlockPool::fiber() {
  BlockPool& p = pool();
  try {
    (*p.job_)();
  } catch (...) {  // an exception must not unwind past the fiber's stack
    if (!p.error_) p.error_ = std::current_exception();
  }
  p.ended_[p.current_] = true;  // then uc_link: back to the scheduler
}

// What the traced calls cost (trace_begin / trace_end): launches of ours, their blocks,
// blocks that load or store no data (idle), data bytes moved (the distinct bytes of each
// warp instruction), 32-byte sectors touched and the fewest that could hold those bytes,
// per warp instruction; plan bytes read (not in `bytes`); host-to-device copies (the VBE
// ops' tables) and their bytes.
struct Counts {
  int64_t launches = 0, blocks = 0, idle_blocks = 0, bytes = 0, sectors = 0, min_sectors = 0,
          instructions = 0, plan_bytes = 0, copies = 0, copy_bytes = 0;
};
Counts counts;

void trace_block() {
  std::vector<emulation::Access> all;
  for (int t = 0; t < kThreads; ++t) {
    emulation::Lane& l = emulation::lanes[t];
    all.insert(all.end(), l.log.begin(), l.log.end());
    counts.plan_bytes += l.plan_bytes;
  }
  if (all.empty()) {
    ++counts.idle_blocks;
    return;
  }
  const auto key = [](const emulation::Access& a) {
    return std::make_tuple(a.warp, a.site, a.tile, a.step, a.seq);
  };
  std::sort(all.begin(), all.end(), [&](const auto& a, const auto& b) {
    return std::make_pair(key(a), a.addr) < std::make_pair(key(b), b.addr);
  });
  for (size_t i = 0; i < all.size();) {
    size_t j = i;
    int64_t bytes = 0, sectors = 0;
    uintptr_t covered = 0, last_sector = ~uintptr_t(0);
    for (; j < all.size() && key(all[j]) == key(all[i]); ++j) {  // sorted by address
      const uintptr_t a = std::max(all[j].addr, covered), e = all[j].addr + all[j].size;
      if (a >= e) continue;
      bytes += e - a;
      covered = e;
      for (uintptr_t sct = a / 32; sct <= (e - 1) / 32; ++sct) {
        if (sct != last_sector) ++sectors;
        last_sector = sct;
      }
    }
    counts.bytes += bytes;
    counts.sectors += sectors;
    counts.min_sectors += (bytes + 31) / 32;
    ++counts.instructions;
    i = j;
  }
}

void trace_begin() {
  counts = Counts{};
  emulation::tracing = true;
}

std::map<std::string, int64_t> trace_end() {
  emulation::tracing = false;
  return {
      {"launches", counts.launches},
      {"blocks", counts.blocks},
      {"idle_blocks", counts.idle_blocks},
      {"bytes", counts.bytes},
      {"sectors", counts.sectors},
      {"min_sectors", counts.min_sectors},
      {"instructions", counts.instructions},
      {"plan_bytes", counts.plan_bytes},
      {"copies", counts.copies},
      {"copy_bytes", counts.copy_bytes}};
}

// The order of a launch's blocks: index order (seed < 0) or a random permutation drawn
// from the seed and the launch's number.
int64_t order_seed = 0;
uint64_t launches = 0;

void set_block_order(int64_t seed) {
  order_seed = seed;
  launches = 0;
}

// Bytes of kernel parameters as the device lays them out (each at its alignment).
template <typename... Args>
constexpr size_t param_bytes() {
  size_t offset = 0;
  ((offset = (offset + alignof(Args) - 1) / alignof(Args) * alignof(Args) + sizeof(Args)), ...);
  return offset;
}

template <typename Kernel, typename... Args>
void emulate_launch(int64_t blocks, int threads, Kernel kernel, const Args&... args) {
  const auto refuse = [](const std::string& why) {
    throw std::invalid_argument("emulated launch over the device's limits: " + why);
  };
  if (blocks < 1 || blocks > kMaxGridX) {
    refuse("grid of " + std::to_string(blocks) + " blocks (1 to 2^31 - 1)");
  }
  if (threads < 1 || threads > kMaxBlockThreads) {
    refuse(std::to_string(threads) + " threads per block (at most 1024)");
  }
  if (threads != kThreads) refuse("the emulation runs blocks of kThreads threads");
  if (param_bytes<Args...>() > kMaxParamBytes) {
    refuse(std::to_string(param_bytes<Args...>()) + " bytes of kernel parameters (at most 4096)");
  }
  std::vector<int64_t> order(blocks);
  std::iota(order.begin(), order.end(), int64_t(0));
  if (order_seed >= 0) {
    std::mt19937_64 rng(static_cast<uint64_t>(order_seed) * 1000003u + launches);
    std::shuffle(order.begin(), order.end(), rng);
  }
  ++launches;
  if (emulation::tracing) {
    ++counts.launches;
    counts.blocks += blocks;
  }
  char* const shared = __start_kt_emu_shared;
  const size_t shared_size = __stop_kt_emu_shared - __start_kt_emu_shared;
  std::vector<char> written(shared_size, 0);   // bytes some block stored to
  std::optional<std::mt19937_64> threads_rng;  // the order of a block's threads
  if (order_seed >= 0) threads_rng.emplace(static_cast<uint64_t>(order_seed) * 7919u + launches);
  for (const int64_t b : order) {
    std::memset(shared, 0xFF, shared_size);
    if (emulation::tracing) {
      for (int t = 0; t < kThreads; ++t) emulation::lanes[t].reset();
    }
    pool().run(b, [&] { kernel(args...); }, threads_rng ? &*threads_rng : nullptr);
    if (emulation::tracing) trace_block();
    for (size_t k = 0; k < shared_size; ++k) written[k] |= shared[k] != char(0xFF);
  }
  const size_t used = std::count(written.begin(), written.end(), char(1));
  std::string failed, fault;
  std::swap(failed, emulation::failed);
  std::swap(fault, emulation::fault);
  if (!fault.empty()) throw std::runtime_error(fault);
  if (used > kMaxStaticShared) {
    refuse(std::to_string(used) + " bytes of shared memory written (at most 48 KiB static)");
  }
  if (!failed.empty()) throw std::out_of_range(failed);
}

template <typename Kernel, typename... Args>
void emulate(Kernel kernel, int64_t blocks, const Args&... args) {
  emulate_launch(blocks, kThreads, kernel, args...);
}

// The launcher of the shared host code (vbe_forward_launches, vbe_backward_launches).
const auto emulated = [](auto kernel, int64_t blocks, const auto&... args) {
  emulate(kernel, blocks, args...);
};

// Their table "on the device" (permute.cu copies it there from pinned memory): a tensor
// of its fields, counted as one host-to-device copy.
const auto uploaded = [](const std::vector<int64_t>& fields) {
  at::Tensor t = at::empty({static_cast<int64_t>(fields.size())}, at::kLong);
  std::memcpy(t.mutable_data_ptr<int64_t>(), fields.data(), fields.size() * sizeof(int64_t));
  if (emulation::tracing) {
    ++counts.copies;
    counts.copy_bytes += static_cast<int64_t>(fields.size() * sizeof(int64_t));
  }
  return t;
};

// Outputs filled with a marker (NaN, or -77) that no correct kernel leaves behind.
// Traced: empty, as permute.cu's (the cost model counts the ATen ops the host code calls).
at::Tensor marked(int64_t batch, int64_t width, c10::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  if (emulation::tracing) return at::empty({batch, width}, options);
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
  vbe_forward_launches(plan, inputs, indices, outs, batch, uploaded, emulated);
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
    vbe_backward_launches(
        plan, grads, indices, in_rows, in_lengths, batch, flat, uploaded, emulated);
  return flat;
}

// ---- kernels that break a rule on purpose (tests of the emulation's checks) -----------

// Each block reads shared memory it has not written, then writes it.
__global__ void read_shared_kernel(uint8_t* seen) {
  __shared__ uint8_t scratch[16];
  if (threadIdx.x == 0) {
    std::memcpy(seen + 16 * blockIdx.x, scratch, 16);
    std::memset(scratch, int(blockIdx.x), 16);
  }
}

// What each of `blocks` blocks found in its shared memory before writing it.
at::Tensor unwritten_shared(int64_t blocks) {
  at::Tensor seen = at::zeros({blocks, 16}, at::kByte);
  emulate(&read_shared_kernel, blocks, seen.data_ptr<uint8_t>());
  return seen;
}

__global__ void vector_kernel(char* p, int64_t offset) {
  if (threadIdx.x == 0) {
    uint4* v = reinterpret_cast<uint4*>(p + offset);
    st<__LINE__>(v, ld<__LINE__>(v));
  }
}

// A 16-byte load and store at `offset` bytes from a 16-byte aligned buffer.
void vector_access(int64_t offset) {
  alignas(16) char buffer[64] = {};
  emulate(&vector_kernel, 1, static_cast<char*>(buffer), offset);
}

__global__ void empty_kernel(int64_t) {}

// A launch of `blocks` blocks of `threads` threads.
void launch(int64_t blocks, int64_t threads) {
  emulate_launch(blocks, static_cast<int>(threads), &empty_kernel, int64_t(0));
}

struct Parameters {
  char bytes[4100];
};
__global__ void parameters_kernel(Parameters) {}

// A kernel taking 4100 bytes of parameters.
void many_parameter_bytes() {
  emulate(&parameters_kernel, 1, Parameters{});
}

__global__ void shared_kernel(int64_t bytes) {
  __shared__ volatile char big[64 * 1024];  // volatile: stores kept though never read
  for (int64_t k = threadIdx.x; k < bytes; k += kThreads) big[k] = 0;
}

// A kernel writing `bytes` bytes of a 64 KiB __shared__ array.
void shared_bytes(int64_t bytes) {
  emulate(&shared_kernel, 1, bytes);
}

}  // namespace
}  // namespace kt_regroup::cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &kt_regroup::cuda::forward);
  m.def("into", &kt_regroup::cuda::into);
  m.def("backward", &kt_regroup::cuda::backward);
  m.def("vbe_forward", &kt_regroup::cuda::vbe_forward);
  m.def("vbe_backward", &kt_regroup::cuda::vbe_backward);
  m.def("set_block_order", &kt_regroup::cuda::set_block_order);
  m.def("trace_begin", &kt_regroup::cuda::trace_begin);
  m.def("trace_end", &kt_regroup::cuda::trace_end);
  m.def("unwritten_shared", &kt_regroup::cuda::unwritten_shared);
  m.def("vector_access", &kt_regroup::cuda::vector_access);
  m.def("launch", &kt_regroup::cuda::launch);
  m.def("many_parameter_bytes", &kt_regroup::cuda::many_parameter_bytes);
  m.def("shared_bytes", &kt_regroup::cuda::shared_bytes);
  m.attr("max_tensors") = kt_regroup::cuda::kMaxTensors;
}
