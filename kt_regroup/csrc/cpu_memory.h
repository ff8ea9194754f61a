// Memory for the CPU kernels' large outputs and gradients: a bounded cache of freed
// blocks, optionally in transparent huge pages.
//
// Inside a training step, most of what a regroup costs on a fresh multi-MB output is
// first-touch page faults, not copying: glibc serves every allocation past 32 MiB with a
// fresh mmap, so each step faults in its outputs and gradients again (about 1 GB for the
// seed layout), one fault per 4 KiB page. Blocks this cache keeps when their tensor dies
// come back to the next call of the same size with their pages in place.
//
// Bounds: the cache holds only freed blocks, at most cache_limit bytes of them (default
// 2 GiB, KT_REGROUP_CPU_CACHE_MB; 0 turns it off); when a freed block would pass the
// limit, the oldest cached blocks are released first. kt_regroup.empty_cpu_cache()
// releases them all. Each block is its own mapping (mmap/munmap on Linux), so a released
// block's pages go back to the system at once. A block is reused for a request of at least 3/4 of
// its size.
//
// Huge pages (KT_REGROUP_HUGE_PAGES=1, off by default): new blocks are 2 MiB-aligned,
// rounded to whole 2 MiB pages and madvise(MADV_HUGEPAGE)d before first touch (Linux's
// default THP mode, "madvise", allows this).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

namespace kt_regroup {

// Allocations of at least this many bytes go through the cache (smaller ones to c10's
// CPU allocator, which glibc serves from its heap without fresh pages).
constexpr int64_t kCachedMinBytes = int64_t(4) << 20;

// at::empty on the CPU; from kCachedMinBytes up the storage comes from the cache (or a
// new block). `warm`, when given, is set to whether its pages are already faulted in (a
// reused block). The storage is an ordinary resizable CPU storage.
at::Tensor empty_cpu(
    c10::IntArrayRef sizes, const c10::TensorOptions& options, bool* warm = nullptr);

// A boolean environment variable: 1/0, true/false, on/off, yes/no (any case); unset or
// empty gives `fallback`, anything else `fallback` with a warning naming the variable.
bool env_flag(const char* name, bool fallback);

// empty_cpu, zero-filled.
at::Tensor zeros_cpu(
    c10::IntArrayRef sizes, const c10::TensorOptions& options, bool* warm = nullptr);

}  // namespace kt_regroup
