// The CPU kernels' output memory (see cpu_memory.h).

#include "cpu_memory.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>

#if defined(__linux__)
#include <pthread.h>
#include <sys/mman.h>
#endif

namespace kt_regroup {

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "off" || s == "no") return false;
  TORCH_WARN(
      "kt_regroup: ignoring ", name, "='", v,
      "': expected 1 or 0 (or true/false, on/off, "
      "yes/no); using the default, ",
      fallback ? "on" : "off");
  return fallback;
}

namespace {

constexpr size_t kPage = size_t(4) << 10;
constexpr size_t kHugePage = size_t(2) << 20;

// The cache limit from KT_REGROUP_CPU_CACHE_MB (MiB), or `fallback` with a warning that
// names the variable when it is not a whole number of MiB in [0, 2^43).
int64_t env_cache_limit(int64_t fallback) {
  const char* name = "KT_REGROUP_CPU_CACHE_MB";
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  constexpr int64_t kMaxMiB = (int64_t(1) << 43) - 1;  // << 20 stays inside int64
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || errno == ERANGE || parsed < 0 || parsed > kMaxMiB) {
    TORCH_WARN(
        "kt_regroup: ignoring ", name, "='", v, "': expected a whole number of MiB from 0 to ",
        kMaxMiB, " (0 turns the cache off); using the default, ", fallback >> 20, " MiB");
    return fallback;
  }
  return static_cast<int64_t>(parsed) << 20;
}

// Blocks are whole mappings of their own (mmap/munmap where there is mmap): releasing one
// returns its pages to the system at once, where a heap block freed to glibc would stay
// in the process (blocks of 4-32 MiB come from the heap once glibc has raised its mmap
// threshold).
void* map_block(size_t bytes, size_t align) {
#if defined(__linux__)
  // Over-map by the alignment, then unmap the slack on both sides.
  const size_t span = bytes + (align > kPage ? align : 0);
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + align - 1) / align * align;
  if (start > base) munmap(m, start - base);
  const uintptr_t end = start + bytes;
  if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
  return reinterpret_cast<void*>(start);
#else
  void* p = nullptr;
  return posix_memalign(&p, align, bytes) == 0 ? p : nullptr;
#endif
}

void unmap_block(void* p, size_t bytes) {
#if defined(__linux__)
  munmap(p, bytes);
#else
  (void)bytes;
  std::free(p);
#endif
}

struct Block {
  void* ptr;
  size_t bytes;
};

class BlockCache final : public c10::Allocator {
 public:
  BlockCache()
      : limit_(env_cache_limit(int64_t(2048) << 20)),
        huge_(env_flag("KT_REGROUP_HUGE_PAGES", false)) {}

  // A block of at least `nbytes`; `warm` tells whether it was reused.
  c10::DataPtr take(size_t nbytes, bool* warm) {
    if (nbytes < static_cast<size_t>(kCachedMinBytes)) {
      if (warm) *warm = false;
      return c10::GetCPUAllocator()->allocate(nbytes);
    }
    {
      std::lock_guard<std::mutex> guard(mu_);
      // The smallest cached block that fits and is not 4/3 of the request or more.
      size_t best = free_.size();
      for (size_t k = 0; k < free_.size(); ++k) {
        const size_t b = free_[k].bytes;
        if (b >= nbytes && b / 4 * 3 <= nbytes && (best == free_.size() || b < free_[best].bytes)) {
          best = k;
        }
      }
      if (best != free_.size()) {
        Block* block = new Block(free_[best]);
        cached_ -= block->bytes;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        ++hits_;
        if (warm) *warm = true;
        return {block->ptr, block, &give_back, c10::Device(c10::DeviceType::CPU)};
      }
      ++misses_;
    }
    if (warm) *warm = false;
    const bool huge = huge_.load(std::memory_order_relaxed);
    const size_t align = huge ? kHugePage : kPage;
    const size_t rounded = (nbytes + align - 1) / align * align;
    void* p = map_block(rounded, align);
    if (p == nullptr) {
      return c10::GetCPUAllocator()->allocate(nbytes);  // let c10 report the failure
    }
#if defined(__linux__)
    if (huge) (void)madvise(p, rounded, MADV_HUGEPAGE);  // a refusal leaves small pages
#endif
    return {p, new Block{p, rounded}, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DataPtr allocate(size_t nbytes) override { return take(nbytes, nullptr); }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;  // each block carries its size: no single raw deleter
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // [cached bytes, cache limit, huge pages, hits, misses] after applying the settings;
  // `empty` releases every cached block first (the limit stays), in the same locked step.
  std::vector<int64_t> configure(
      std::optional<int64_t> limit, std::optional<bool> huge, bool empty) {
    TORCH_CHECK(
        !limit || *limit >= 0, "kt_regroup: the CPU cache limit must be >= 0, got ", *limit);
    std::deque<Block> released;
    std::vector<int64_t> state;
    {
      std::lock_guard<std::mutex> guard(mu_);
      if (huge) huge_ = *huge;
      if (empty) evict_to(0, released);
      if (limit) {
        limit_ = *limit;
        evict_to(static_cast<size_t>(*limit), released);
      }
      state = {static_cast<int64_t>(cached_), limit_.load(), huge_.load() ? 1 : 0, hits_, misses_};
    }
    for (const Block& b : released) unmap_block(b.ptr, b.bytes);  // outside the lock
    return state;
  }

  static BlockCache& get() {
    static BlockCache* cache = [] {
      auto* c = new BlockCache();  // never destroyed: tensors may outlive static destructors
#if defined(__linux__)
      // No thread holds the lock across fork(): the child may allocate at once.
      pthread_atfork(
          [] { get().mu_.lock(); }, [] { get().mu_.unlock(); }, [] { get().mu_.unlock(); });
#endif
      return c;
    }();
    return *cache;
  }

 private:
  static void give_back(void* ctx) { get().put(static_cast<Block*>(ctx)); }

  void put(Block* block) {
    const Block b = *block;
    delete block;
    std::deque<Block> released;
    {
      std::lock_guard<std::mutex> guard(mu_);
      const size_t limit = static_cast<size_t>(limit_.load(std::memory_order_relaxed));
      if (b.bytes <= limit) {
        evict_to(limit - b.bytes, released);
        free_.push_back(b);
        cached_ += b.bytes;
      } else {
        released.push_back(b);
      }
    }
    for (const Block& r : released) unmap_block(r.ptr, r.bytes);  // outside the lock
  }

  // Oldest first, until at most `bytes` stay cached. Called under mu_.
  void evict_to(size_t bytes, std::deque<Block>& released) {
    while (cached_ > bytes && !free_.empty()) {
      cached_ -= free_.front().bytes;
      released.push_back(free_.front());
      free_.pop_front();
    }
  }

  std::mutex mu_;
  std::deque<Block> free_;  // oldest first
  size_t cached_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  std::atomic<int64_t> limit_;
  std::atomic<bool> huge_;
};

std::vector<int64_t> cpu_memory(
    std::optional<int64_t> cache_limit, std::optional<bool> huge_pages, bool empty) {
  return BlockCache::get().configure(cache_limit, huge_pages, empty);
}

}  // namespace

at::Tensor empty_cpu(c10::IntArrayRef sizes, const c10::TensorOptions& options, bool* warm) {
  const c10::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  const size_t nbytes = at::detail::computeStorageNbytesContiguous(sizes, c10::elementSize(dtype));
  if (warm) *warm = false;
  // Small ones: c10's CPU allocator, as at::empty, without a trip through the dispatcher.
  if (nbytes < static_cast<size_t>(kCachedMinBytes)) return at::detail::empty_cpu(sizes, options);
  BlockCache& cache = BlockCache::get();
  c10::DataPtr data = cache.take(nbytes, warm);
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(data), &cache, /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

at::Tensor zeros_cpu(c10::IntArrayRef sizes, const c10::TensorOptions& options, bool* warm) {
  return empty_cpu(sizes, options, warm).zero_();
}

}  // namespace kt_regroup

TORCH_LIBRARY_FRAGMENT(kt_regroup, m) {
  // kt_regroup.cpu_memory() / empty_cpu_cache(): the output cache's state and settings.
  m.def(
      "_cpu_memory(int? cache_limit=None, bool? huge_pages=None, bool empty=False) -> int[]",
      TORCH_FN(kt_regroup::cpu_memory));
}
