// Large CPU outputs in transparent huge pages.
//
// Most of the time a regroup spends on a fresh multi-MB output goes to first-touch page
// faults, not to copying: 4 KiB pages fault once per 4 KiB. Memory that is 2 MiB-aligned
// and madvise(MADV_HUGEPAGE)d before it is first touched faults once per 2 MiB, in
// Linux's default THP mode ("madvise"). This is what c10's CPU allocator does under
// THP_MEM_ALLOC_ENABLE=1, here only for the regroup's own outputs and gradients.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

namespace kt_regroup {

// Outputs of at least this many bytes go to huge pages.
constexpr int64_t kHugePageMinBytes = int64_t(4) << 20;

// Whether large outputs go to huge pages: Linux, and KT_REGROUP_HUGE_PAGES is not "0"
// (read once, at the first call).
bool huge_pages_enabled();

// at::empty on the CPU; from kHugePageMinBytes up (when enabled) the storage is
// 2 MiB-aligned, rounded up to whole 2 MiB pages and madvise(MADV_HUGEPAGE)d before
// first touch. Where madvise fails the memory is used as it is. The storage is an
// ordinary resizable CPU storage whose allocator does the same on resize.
at::Tensor empty_cpu(c10::IntArrayRef sizes, const c10::TensorOptions& options);

// empty_cpu, zero-filled.
at::Tensor zeros_cpu(c10::IntArrayRef sizes, const c10::TensorOptions& options);

}  // namespace kt_regroup
