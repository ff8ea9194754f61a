// Shared declarations of kt_regroup's native kernels.
//
// The op schemas live in Python (kt_regroup/ops.py); the C++ code only registers
// implementations for them (CPU kernels, the Autograd kernel), so the ops and their
// fake kernels exist even when this extension is not built.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <string>
#include <vector>

namespace kt_regroup {

// One coalesced copy: out[out_t][:, out_off:out_off+length] = in[in_t][:, in_off:...].
struct Segment {
  int64_t in_t;
  int64_t out_t;
  int64_t in_off;
  int64_t out_off;
  int64_t length;
};

// Python-style spellings, so C++ messages read exactly like validation.py's.
std::string py_dtype(c10::ScalarType t);
std::string py_shape(c10::IntArrayRef shape);

// Validates a forward call with the wording of kernels/validation.py and returns the
// permute rows coalesced (adjacent contiguous rows merged, zero-length rows dropped).
std::vector<Segment> check_forward(
    const char* op,
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths);

// The byte-copy forward writing into `outs` (one [batch, out_lengths[j]] contiguous
// tensor per output). Columns covered by no segment are left untouched.
void permute_forward_into(
    at::TensorList pooled_embs,
    const std::vector<Segment>& segments,
    at::TensorList outs);

// Whether the segments write every column of every output exactly once, in order.
bool segments_tile_outputs(const std::vector<Segment>& segments, c10::IntArrayRef out_lengths);

}  // namespace kt_regroup
