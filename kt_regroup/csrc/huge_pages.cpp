// Large CPU outputs in transparent huge pages (see huge_pages.h).

#include "huge_pages.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kt_regroup {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;

#if defined(__linux__)
void free_huge(void* p) {
  std::free(p);
}

// Huge-page memory for large requests, c10's CPU allocator for the rest (a resize
// may shrink a storage below the threshold).
struct HugePageAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < static_cast<size_t>(kHugePageMinBytes)) {
      return c10::GetCPUAllocator()->allocate(nbytes);
    }
    const size_t rounded = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, rounded) != 0 || p == nullptr) {
      return c10::GetCPUAllocator()->allocate(nbytes);  // let c10 report the failure
    }
    // Before the first touch; a refusal (THP off, old kernel) leaves small pages.
    (void)madvise(p, rounded, MADV_HUGEPAGE);
    return {p, p, &free_huge, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;  // two kinds of memory: no single raw deleter
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HugePageAllocator& huge_page_allocator() {
  static HugePageAllocator allocator;
  return allocator;
}
#endif

}  // namespace

bool huge_pages_enabled() {
#if defined(__linux__)
  static const bool enabled = [] {
    const char* v = std::getenv("KT_REGROUP_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
#else
  return false;
#endif
}

at::Tensor empty_cpu(c10::IntArrayRef sizes, const c10::TensorOptions& options) {
#if defined(__linux__)
  const size_t nbytes = at::detail::computeStorageNbytesContiguous(
      sizes, c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  if (nbytes >= static_cast<size_t>(kHugePageMinBytes) && huge_pages_enabled()) {
    return at::detail::empty_generic(
        sizes, &huge_page_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
        c10::typeMetaToScalarType(options.dtype()), std::nullopt);
  }
#endif
  return at::empty(sizes, options);
}

at::Tensor zeros_cpu(c10::IntArrayRef sizes, const c10::TensorOptions& options) {
  return empty_cpu(sizes, options).zero_();
}

}  // namespace kt_regroup
