// The variable-batch (VBE) regroup: per-feature pooled tensors whose rows are shared by
// several samples, expanded by index tensors and regrouped in one pass.
//
//   permute_multi_embedding_vbe(pooled_embs, indices, permutes, ...)[j][b, out_cols]
//       = pooled_embs[i][indices[i][b], in_cols]        for every permute row (i -> j)
//
// indices[i] None (or an empty list): input i has one row per sample. The plan is the
// permute-row format of permute_multi_embedding. The backward accumulates every sample's
// gradient into its row in sample order (each task owns its inputs' rows and reads the
// gradients sample by sample: deterministic, no atomics), duplicated keys summed in plan order,
// unused rows exact zeros. The backward op returns the input gradients as one flat
// tensor (an op may not return aliases of one allocation); the autograd splits it into
// per-input views.
//
// The checks, the CPU kernels, a portable kernel (ATen, every device without a
// kernel of its own) and the autograd live here; the CUDA kernels in cuda/permute.cu and
// cuda/kernels.cuh (the same sums in the same order: the CPU kernel's bits; indices
// checked on the device), the fake kernels in kt_regroup/ops.py.

#include "cpu_memory.h"
#include "kt_regroup.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <tuple>
#include <type_traits>

namespace kt_regroup {
namespace {

using OptionalTensors = c10::List<std::optional<at::Tensor>>;
constexpr const char* kForward = "permute_multi_embedding_vbe";
constexpr const char* kBackward = "permute_multi_embedding_vbe_backward";

// ---- checks ----------------------------------------------------------------------------

bool has_index(const std::vector<std::optional<at::Tensor>>& indices, size_t i) {
  return !indices.empty() && indices[i].has_value() && indices[i]->defined();
}

// The index tensors of a call (nullopt: input i has one row per sample), checked against
// the inputs' row counts: 1-D, int32/int64, the data's device, one length (the batch).
// Returns the batch size; `rows[i]` is input i's row count.
int64_t check_indices(
    const char* op,
    const std::vector<std::optional<at::Tensor>>& indices,
    const std::vector<int64_t>& rows,
    std::optional<c10::Device> device,
    std::optional<int64_t> batch) {
  TORCH_CHECK_VALUE(
      indices.empty() || indices.size() == rows.size(), "kt_regroup.", op, ": indices has ",
      indices.size(), " entries but there are ", rows.size(),
      " inputs; give one per input (None: one row per sample) or none");
  int64_t first = -1;  // the input that fixed the batch size
  for (size_t i = 0; i < rows.size(); ++i) {
    const bool has = has_index(indices, i);
    int64_t n = rows[i];
    if (has) {
      const at::Tensor& idx = *indices[i];
      check_dense(op, "indices", static_cast<int64_t>(i), idx);
      TORCH_CHECK_VALUE(
          idx.dim() == 1, "kt_regroup.", op, ": indices[", i, "] must be 1-D [batch], got ",
          idx.dim(), " dims");
      TORCH_CHECK_TYPE(
          idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, "kt_regroup.", op,
          ": indices[", i, "] must be int32 or int64, got ", idx.scalar_type());
      TORCH_CHECK_VALUE(
          !device.has_value() || idx.device() == *device, "kt_regroup.", op, ": indices[", i,
          "] is on ", idx.device(), " but the data is on ", *device);
      n = idx.size(0);
    }
    if (!batch.has_value()) {
      batch = n;
      first = static_cast<int64_t>(i);
      continue;
    }
    TORCH_CHECK_VALUE(
        n == *batch, "kt_regroup.", op, ": input ", i, " has ", n,
        has ? " samples (the length of indices[" + std::to_string(i) + "])"
            : " rows and no index (indices[" + std::to_string(i) + "] is None)",
        " but the batch has ", *batch,
        first >= 0 ? " (from input " + std::to_string(first) + ")" : std::string());
  }
  return batch.value_or(0);
}

// Every index inside its input: the error names the input and the sample.
void check_ranges(
    const char* op,
    const std::vector<std::optional<at::Tensor>>& indices,
    const std::vector<int64_t>& rows) {
  for (size_t i = 0; i < indices.size(); ++i) {
    if (!has_index(indices, i)) continue;
    const at::Tensor host = indices[i]->is_cpu() ? *indices[i] : indices[i]->cpu();
    AT_DISPATCH_INDEX_TYPES(host.scalar_type(), "check_ranges", [&] {
      const index_t* p = host.const_data_ptr<index_t>();
      // A stride-0 index (expand) holds one value whatever its length: checked once.
      const int64_t s = host.stride(0),
                    n = s == 0 ? std::min<int64_t>(host.size(0), 1) : host.size(0);
      for (int64_t b = 0; b < n; ++b) {
        const int64_t v = static_cast<int64_t>(p[b * s]);
        TORCH_CHECK_INDEX(
            v >= 0 && v < rows[i], "kt_regroup.", op, ": indices[", i, "][", b, "] = ", v,
            " is out of range for input ", i, ", which has ", rows[i], " rows");
      }
    });
  }
}

}  // namespace

VbeChecked check(const VbeCall& call, const PlanArgs& args) {
  const char* op = call.backward ? kBackward : kForward;
  const TensorPtrs& ts = call.tensors;
  VbeChecked k{nullptr, {call.indices.begin(), call.indices.end()}, 0};
  std::vector<int64_t> rows;
  if (!call.backward) {
    k.plan = check({op, Kind::kVbe, ts, 0, {}, call.device_kernel}, args);
    for (const at::Tensor* t : ts) rows.push_back(t->size(0));
    k.batch = check_indices(op, k.indices, rows, ts[0]->device(), std::nullopt);
    check_output_elements(op, "out_lengths", args.lengths, k.batch);
  } else {
    TORCH_CHECK_VALUE(
        call.in_rows.size() == args.lengths.size(), "kt_regroup.", op, ": in_rows has ",
        call.in_rows.size(), " entries but in_lengths has ", args.lengths.size());
    rows.assign(call.in_rows.begin(), call.in_rows.end());
    for (size_t i = 0; i < rows.size(); ++i) {
      TORCH_CHECK_VALUE(
          rows[i] >= 0, "kt_regroup.", op, ": in_rows[", i, "] is negative (", rows[i], ")");
    }
    std::optional<c10::Device> device;
    std::optional<int64_t> batch;
    for (const at::Tensor* g : ts) {
      if (g && g->dim() >= 1) {
        device = g->device();
        batch = g->size(0);
      }
    }
    for (size_t j = 0; j < ts.size(); ++j) {
      if (ts[j]) check_dense(op, "grad_outputs", static_cast<int64_t>(j), *ts[j]);
      TORCH_CHECK_TYPE(
          !ts[j] || ts[j]->scalar_type() == call.dtype, "kt_regroup.", op, ": grad_outputs[", j,
          "] is ", ts[j] ? ts[j]->scalar_type() : call.dtype, " but dtype is ", call.dtype,
          "; the gradients must have the inputs' dtype");
    }
    k.batch = check_indices(op, k.indices, rows, device, batch);
    k.plan = check({op, Kind::kBackward, ts, k.batch, {}, call.device_kernel}, args);
  }
  // The indices' values: on the device, by the kernels.
  if (!call.device_kernel) check_ranges(op, k.indices, rows);
  return k;
}

namespace {

// The input gradients: views of one allocation (on the CPU from the output cache, whose
// blocks come back with their pages in place), not zeroed.
std::vector<at::Tensor> gradient_views(
    c10::IntArrayRef in_rows,
    c10::IntArrayRef in_lengths,
    const at::TensorOptions& options,
    at::Tensor* buffer) {
  int64_t total = 0;
  for (size_t i = 0; i < in_rows.size(); ++i) total += in_rows[i] * in_lengths[i];
  *buffer = options.device().is_cpu() ? empty_cpu({total}, options) : at::empty({total}, options);
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (size_t i = 0; i < in_rows.size(); ++i) {
    const int64_t n = in_rows[i] * in_lengths[i];
    out.push_back(buffer->as_strided({in_rows[i], in_lengths[i]}, {in_lengths[i], 1}, offset));
    offset += n;
  }
  return out;
}

// The backward's sums, in unpatched torchrec's order (group_index_select_dim0, then the
// regroup): per sample, the gradients of every segment that reads an input column, in
// plan order; then per row, those sums of its samples, in sample order. A Piece is a run
// of one segment's columns that is the only read of its columns (kOnce: added straight
// into the row), the first of several (kFirst: starts the sample's sum) or a later one
// (kAdd). `shared` lists the input's columns read more than once.
struct Piece {
  enum Kind { kOnce, kFirst, kAdd };
  const Segment* segment;
  int64_t skip;  // columns from the segment's start
  int64_t length;
  Kind kind;
};

struct InputSums {
  std::vector<Piece> pieces;
  std::vector<std::pair<int64_t, int64_t>> shared;  // [begin, end) input columns
  std::vector<std::pair<int64_t, int64_t>> unread;  // [begin, end) input columns
};

// Per input, its pieces (segments whose gradient is None are left out: they add zeros).
std::vector<InputSums> input_sums(
    const std::vector<Segment>& segments, const TensorPtrs& grads, c10::IntArrayRef in_lengths) {
  std::vector<InputSums> out(in_lengths.size());
  std::vector<std::vector<int32_t>> reads(in_lengths.size());
  for (const Segment& s : segments) {
    if (!grads[s.out_t]) continue;
    std::vector<int32_t>& r = reads[s.in_t];
    if (r.empty()) r.assign(in_lengths[s.in_t], 0);
    for (int64_t c = s.in_off; c < s.in_off + s.length; ++c) ++r[c];
  }
  // Runs of equal values of f(c) over [begin, end), as (begin, end, value).
  auto runs = [](int64_t begin, int64_t end, auto f, auto emit) {
    while (begin < end) {
      const auto v = f(begin);
      int64_t stop = begin + 1;
      while (stop < end && f(stop) == v) ++stop;
      emit(begin, stop, v);
      begin = stop;
    }
  };
  std::vector<std::vector<bool>> seen(in_lengths.size());
  for (const Segment& s : segments) {
    if (!grads[s.out_t]) continue;
    const std::vector<int32_t>& r = reads[s.in_t];
    std::vector<bool>& done = seen[s.in_t];
    if (done.empty()) done.assign(in_lengths[s.in_t], false);
    auto kind = [&](int64_t c) {
      return r[c] == 1 ? Piece::kOnce : done[c] ? Piece::kAdd : Piece::kFirst;
    };
    runs(s.in_off, s.in_off + s.length, kind, [&](int64_t b, int64_t e, Piece::Kind k) {
      out[s.in_t].pieces.push_back(Piece{&s, b - s.in_off, e - b, k});
    });
    for (int64_t c = s.in_off; c < s.in_off + s.length; ++c) done[c] = true;
  }
  for (size_t i = 0; i < in_lengths.size(); ++i) {
    const std::vector<int32_t>& r = reads[i];
    auto count = [&](int64_t c) { return r.empty() ? 0 : std::min<int32_t>(r[c], 2); };
    runs(0, in_lengths[i], count, [&](int64_t b, int64_t e, int32_t n) {
      if (n == 0) out[i].unread.emplace_back(b, e);
      if (n == 2) out[i].shared.emplace_back(b, e);
    });
  }
  return out;
}

// ---- portable kernels (ATen; every device without a native kernel) -------------------------

std::vector<at::Tensor> vbe_portable(
    at::TensorList pooled_embs,
    const OptionalTensors& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  const VbeChecked f = check(
      {false, pointers(pooled_embs), indices}, {permutes, in_shapes, out_shapes, out_lengths});
  std::vector<at::Tensor> outs;
  for (int64_t n : out_lengths) outs.push_back(at::zeros({f.batch, n}, pooled_embs[0].options()));
  for (const Segment& s : f.plan->segments) {
    at::Tensor src = pooled_embs[s.in_t].narrow(1, s.in_off, s.length);
    if (has_index(f.indices, s.in_t)) src = src.index_select(0, *f.indices[s.in_t]);
    outs[s.out_t].narrow(1, s.out_off, s.length).copy_(src);
  }
  return outs;
}

}  // namespace

at::Tensor vbe_backward_portable(
    const OptionalTensors& grad_outputs,
    const OptionalTensors& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    c10::IntArrayRef in_rows,
    c10::ScalarType dtype) {
  HeldTensors held;
  const VbeCall call{true, grad_pointers(grad_outputs, held), indices, in_rows, dtype};
  const VbeChecked k = check(call, {permutes, in_shapes, out_shapes, in_lengths});
  const c10::Device device = gradients_device(call.tensors, permutes);
  at::Tensor buffer;
  std::vector<at::Tensor> grads =
      gradient_views(in_rows, in_lengths, at::TensorOptions().dtype(dtype).device(device), &buffer);
  buffer.zero_();
  const std::vector<InputSums> sums = input_sums(k.plan->segments, call.tensors, in_lengths);
  for (size_t i = 0; i < sums.size(); ++i) {
    if (sums[i].pieces.empty()) continue;
    // Each sample's sum over the segments that read a column, then the rows' sums.
    at::Tensor per_sample = has_index(k.indices, i)
                                ? at::zeros({k.batch, in_lengths[i]}, grads[i].options())
                                : grads[i];
    for (const Piece& p : sums[i].pieces) {
      const Segment& s = *p.segment;
      const at::Tensor src = call.tensors[s.out_t]->narrow(1, s.out_off + p.skip, p.length);
      at::Tensor dst = per_sample.narrow(1, s.in_off + p.skip, p.length);
      if (p.kind == Piece::kAdd) {
        dst.add_(src);
      } else {
        dst.copy_(src);
      }
    }
    if (has_index(k.indices, i)) grads[i].index_add_(0, *k.indices[i], per_sample);
  }
  return buffer;
}

namespace {

// ---- CPU kernels -----------------------------------------------------------------------------

// A 2-D tensor whose rows are contiguous runs (unit column stride).
at::Tensor rows_contiguous(const at::Tensor& t) {
  return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous();
}

// Row r of an input for sample b: through its index, or b.
struct RowMap {
  const void* data = nullptr;  // nullptr for an empty index too: `indexed` tells
  int64_t stride = 0;
  bool is32 = false;
  bool indexed = false;
  int64_t operator()(int64_t b) const {
    if (!indexed) return b;
    return is32 ? static_cast<const int32_t*>(data)[b * stride]
                : static_cast<const int64_t*>(data)[b * stride];
  }
};

std::vector<RowMap> row_maps(
    const std::vector<std::optional<at::Tensor>>& indices,
    size_t n_in,
    std::vector<at::Tensor>& keep) {
  std::vector<RowMap> maps(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    if (!has_index(indices, i)) continue;
    const at::Tensor& idx = *indices[i];
    keep.push_back(idx);
    maps[i] = RowMap{idx.const_data_ptr(), idx.stride(0), idx.scalar_type() == at::kInt, true};
  }
  return maps;
}

// Bytes of indexed input rows one CPU task reads (forward) or accumulates (backward):
// they stay in cache while the task goes over the samples in order.
constexpr int64_t kTaskBytes = 512 * 1024;

std::vector<at::Tensor> vbe_cpu(
    at::TensorList pooled_embs,
    const OptionalTensors& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  const VbeChecked f = check(
      {false, pointers(pooled_embs), indices}, {permutes, in_shapes, out_shapes, out_lengths});
  const at::TensorOptions options = pooled_embs[0].options();
  std::vector<at::Tensor> outs;
  for (int64_t n : out_lengths) {  // from the output cache: warm pages where it has them
    outs.push_back(
        f.plan->tiled ? empty_cpu({f.batch, n}, options) : zeros_cpu({f.batch, n}, options));
  }
  const std::vector<Segment>& segments = f.plan->segments;
  if (f.batch == 0 || segments.empty()) return outs;
  std::vector<at::Tensor> inputs;
  for (const at::Tensor& t : pooled_embs) inputs.push_back(rows_contiguous(t));
  std::vector<at::Tensor> keep;
  const std::vector<RowMap> maps = row_maps(f.indices, inputs.size(), keep);
  const int64_t es = static_cast<int64_t>(options.dtype().itemsize());
  struct Copy {
    const char* src;
    int64_t src_stride;  // bytes per input row
    char* dst;
    int64_t dst_stride;
    int64_t bytes;
    const RowMap* map;
  };
  std::vector<Copy> copies;
  int64_t bytes = 0;
  for (const Segment& s : segments) {
    const at::Tensor& in = inputs[s.in_t];
    const at::Tensor& out = outs[s.out_t];
    copies.push_back(Copy{
        static_cast<const char*>(in.const_data_ptr()) + s.in_off * es, in.stride(0) * es,
        static_cast<char*>(out.data_ptr()) + s.out_off * es, out.stride(0) * es, s.length * es,
        &maps[s.in_t]});
    bytes += f.batch * s.length * es;
  }
  // Tasks: runs of copies, in output order, that read about kTaskBytes of rows, each over
  // sample ranges that write about kTaskBytes: a task's rows stay in cache. Where segments
  // overlap, one run in plan order (a later segment's columns win). Less than kGrainBytes
  // in all runs inline.
  std::vector<size_t> order(copies.size());
  std::iota(order.begin(), order.end(), size_t(0));
  if (f.plan->tiled) {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const Segment &x = segments[a], &y = segments[b];
      return std::tie(x.out_t, x.out_off) < std::tie(y.out_t, y.out_off);
    });
  }
  struct Task {
    size_t begin, end;  // into order
    int64_t b0, b1;     // samples
  };
  std::vector<Task> tasks;
  auto add = [&](size_t begin, size_t end, int64_t per_sample) {
    const int64_t step = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, per_sample));
    for (int64_t b = 0; b < f.batch; b += step) {
      tasks.push_back(Task{begin, end, b, std::min(f.batch, b + step)});
    }
  };
  size_t begin = 0;
  int64_t read = 0, per_sample = 0;
  for (size_t q = 0; q < order.size(); ++q) {
    const Segment& s = segments[order[q]];
    const int64_t rows = maps[s.in_t].indexed ? inputs[s.in_t].size(0) : f.batch;
    const int64_t size = rows * s.length * es;
    if (f.plan->tiled && q > begin && read + size > kTaskBytes) {
      add(begin, q, per_sample);
      begin = q;
      read = per_sample = 0;
    }
    read += size;
    per_sample += s.length * es;
  }
  add(begin, order.size(), per_sample);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = bytes < kGrainBytes ? std::max<int64_t>(1, n_tasks) : 1;
  at::parallel_for(0, n_tasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      for (int64_t b = task.b0; b < task.b1; ++b) {
        for (size_t q = task.begin; q < task.end; ++q) {
          const Copy& c = copies[order[q]];
          std::memcpy(c.dst + b * c.dst_stride, c.src + (*c.map)(b)*c.src_stride, c.bytes);
        }
      }
    }
  });
  return outs;
}

// One sample's gradient of input columns: kOnce pieces into `acc` (acc_t) or straight
// into `out` (scalar_t), kFirst/kAdd pieces into `sum`, which the caller then adds.
template <typename scalar_t, typename acc_t, bool kAccumulate>
inline void add_sample(
    const InputSums& sums,
    const std::vector<at::Tensor>& grad_outs,
    int64_t b,
    acc_t* acc,
    scalar_t* out,
    acc_t* sum) {
  for (const Piece& p : sums.pieces) {
    const Segment& s = *p.segment;
    const at::Tensor& g = grad_outs[s.out_t];
    const scalar_t* src = g.const_data_ptr<scalar_t>() + b * g.stride(0) + s.out_off + p.skip;
    const int64_t col = s.in_off + p.skip;
    if (p.kind == Piece::kOnce) {
      if constexpr (kAccumulate) {
        for (int64_t c = 0; c < p.length; ++c) acc[col + c] += static_cast<acc_t>(src[c]);
      } else {
        std::memcpy(out + col, src, p.length * sizeof(scalar_t));
      }
    } else if (p.kind == Piece::kFirst) {
      for (int64_t c = 0; c < p.length; ++c) sum[col + c] = static_cast<acc_t>(src[c]);
    } else {
      for (int64_t c = 0; c < p.length; ++c) sum[col + c] += static_cast<acc_t>(src[c]);
    }
  }
}

template <typename scalar_t>
void vbe_backward_cpu_typed(
    const VbeChecked& k,
    const TensorPtrs& grad_ptrs,
    const std::vector<at::Tensor>& grad_outs,  // undefined: None
    c10::IntArrayRef in_rows,
    c10::IntArrayRef in_lengths,
    std::vector<at::Tensor>& grads) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  constexpr bool kInPlace = std::is_same_v<acc_t, scalar_t>;  // accumulate in the gradients
  const int64_t n_in = static_cast<int64_t>(in_rows.size());
  const std::vector<InputSums> sums = input_sums(k.plan->segments, grad_ptrs, in_lengths);
  std::vector<at::Tensor> keep;
  const std::vector<RowMap> maps = row_maps(k.indices, n_in, keep);
  // Tasks own disjoint inputs, so no two threads write one element: an input without an
  // index (row r is sample r) or without gradients alone; indexed inputs in runs of about
  // kTaskBytes of rows, ordered by where their first gradient block lies (neighbouring
  // columns of the gradient rows).
  std::vector<int64_t> order, starts;
  std::vector<int64_t> indexed;
  int64_t bytes = 0;
  for (int64_t i = 0; i < n_in; ++i) {
    for (const Piece& p : sums[i].pieces) bytes += k.batch * p.length * int64_t(sizeof(scalar_t));
    if (maps[i].indexed && !sums[i].pieces.empty() && in_rows[i] * in_lengths[i] > 0) {
      indexed.push_back(i);
    } else {
      starts.push_back(static_cast<int64_t>(order.size()));
      order.push_back(i);
    }
  }
  auto first = [&](int64_t i) {
    const Segment& s = *sums[i].pieces.front().segment;
    return std::make_pair(s.out_t, s.out_off + sums[i].pieces.front().skip);
  };
  std::stable_sort(
      indexed.begin(), indexed.end(), [&](int64_t a, int64_t b) { return first(a) < first(b); });
  int64_t run = kTaskBytes;
  for (int64_t i : indexed) {
    const int64_t size = in_rows[i] * in_lengths[i] * int64_t(sizeof(acc_t));
    if (run + size > kTaskBytes) {
      starts.push_back(static_cast<int64_t>(order.size()));
      run = 0;
    }
    run += size;
    order.push_back(i);
  }
  const int64_t n_tasks = static_cast<int64_t>(starts.size());
  starts.push_back(static_cast<int64_t>(order.size()));
  // Less than kGrainBytes of gradient in all runs inline (no thread to wake).
  const int64_t grain = bytes < kGrainBytes ? std::max<int64_t>(1, n_tasks) : 1;
  at::parallel_for(0, n_tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<acc_t> buffer, sum;
    std::vector<acc_t*> accs;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* inputs = order.data() + starts[t];
      const int64_t n = starts[t + 1] - starts[t];
      const int64_t i = inputs[0];
      const InputSums& s = sums[i];
      if (in_rows[i] * in_lengths[i] == 0) continue;
      scalar_t* out = grads[i].data_ptr<scalar_t>();
      if (s.pieces.empty()) {
        std::fill(out, out + in_rows[i] * in_lengths[i], scalar_t(0));
        continue;
      }
      const int64_t width = in_lengths[i];
      if (!maps[i].indexed) {  // row r is sample r: its sum is its gradient
        sum.resize(width);
        for (int64_t r = 0; r < in_rows[i]; ++r) {
          scalar_t* o = out + r * width;
          add_sample<scalar_t, acc_t, false>(s, grad_outs, r, nullptr, o, sum.data());
          for (const auto& [b, e] : s.shared) {
            for (int64_t c = b; c < e; ++c) o[c] = static_cast<scalar_t>(sum[c]);
          }
          for (const auto& [b, e] : s.unread) std::fill(o + b, o + e, scalar_t(0));
        }
        continue;
      }
      // Each row the sum of its samples' gradients, in sample order, from zero.
      int64_t total = 0, widest = 0;
      for (int64_t q = 0; q < n; ++q) {
        total += in_rows[inputs[q]] * in_lengths[inputs[q]];
        widest = std::max(widest, in_lengths[inputs[q]]);
      }
      if (!kInPlace) buffer.resize(total);
      sum.resize(widest);
      accs.clear();
      int64_t offset = 0;
      for (int64_t q = 0; q < n; ++q) {
        const int64_t j = inputs[q], size = in_rows[j] * in_lengths[j];
        acc_t* a = kInPlace ? reinterpret_cast<acc_t*>(grads[j].data_ptr<scalar_t>())
                            : buffer.data() + offset;
        std::fill(a, a + size, acc_t(0));
        accs.push_back(a);
        offset += size;
      }
      for (int64_t b = 0; b < k.batch; ++b) {
        for (int64_t q = 0; q < n; ++q) {
          const int64_t j = inputs[q];
          acc_t* row = accs[q] + maps[j](b) * in_lengths[j];
          add_sample<scalar_t, acc_t, true>(sums[j], grad_outs, b, row, nullptr, sum.data());
          for (const auto& [lo, hi] : sums[j].shared) {
            for (int64_t c = lo; c < hi; ++c) row[c] += sum[c];
          }
        }
      }
      if constexpr (!kInPlace) {
        for (int64_t q = 0; q < n; ++q) {
          const int64_t j = inputs[q], size = in_rows[j] * in_lengths[j];
          scalar_t* o = grads[j].data_ptr<scalar_t>();
          for (int64_t e = 0; e < size; ++e) o[e] = static_cast<scalar_t>(accs[q][e]);
        }
      }
    }
  });
}

at::Tensor vbe_backward_cpu(
    const OptionalTensors& grad_outputs,
    const OptionalTensors& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    c10::IntArrayRef in_rows,
    c10::ScalarType dtype) {
  if (!is_float(dtype)) {
    return vbe_backward_portable(
        grad_outputs, indices, permutes, in_shapes, out_shapes, in_lengths, in_rows, dtype);
  }
  HeldTensors held;
  const VbeCall call{true, grad_pointers(grad_outputs, held), indices, in_rows, dtype};
  const VbeChecked k = check(call, {permutes, in_shapes, out_shapes, in_lengths});
  std::vector<at::Tensor> grad_outs;
  for (const at::Tensor* g : call.tensors) {
    grad_outs.push_back(g ? rows_contiguous(*g) : at::Tensor());
  }
  at::Tensor buffer;
  std::vector<at::Tensor> grads =
      gradient_views(in_rows, in_lengths, at::TensorOptions().dtype(dtype), &buffer);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "vbe_backward_cpu", [&] {
    vbe_backward_cpu_typed<scalar_t>(k, call.tensors, grad_outs, in_rows, in_lengths, grads);
  });
  return buffer;
}

// ---- autograd --------------------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class VbeFunction : public torch::autograd::Function<VbeFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      at::TensorList pooled_embs,
      const OptionalTensors& indices,
      const at::Tensor& permutes,
      const at::Tensor& in_shapes,
      const at::Tensor& out_shapes,
      c10::SymIntArrayRef out_lengths) {
    std::vector<c10::SymInt> widths, rows;
    for (const at::Tensor& t : pooled_embs) {
      rows.push_back(t.dim() == 2 ? t.sym_size(0) : c10::SymInt(0));
      widths.push_back(t.dim() == 2 ? t.sym_size(1) : c10::SymInt(0));
    }
    ctx->saved_data["in_lengths"] = c10::IValue(c10::SymIntArrayRef(widths));
    ctx->saved_data["in_rows"] = c10::IValue(c10::SymIntArrayRef(rows));
    ctx->saved_data["dtype"] = pooled_embs.empty() ? at::kFloat : pooled_embs[0].scalar_type();
    // The indices with a version check (an index changed in place before the backward is
    // autograd's error, as for index_select); an inference tensor, which autograd cannot
    // save, as a copy of our own. The plan tensors are read-only metadata.
    // (apply runs this with grad mode off: whether a node is recorded is not known here)
    const bool records = !c10::InferenceMode::is_enabled() &&
                         std::any_of(
                             pooled_embs.begin(), pooled_embs.end(),
                             [](const at::Tensor& t) { return t.requires_grad(); });
    variable_list saved;
    c10::List<bool> present;
    for (const std::optional<at::Tensor>& idx : indices) {
      const bool has = idx.has_value() && idx->defined();
      present.push_back(has);
      saved.push_back(!has ? at::Tensor() : records && idx->is_inference() ? idx->clone() : *idx);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["indices_present"] = present;
    ctx->saved_data["permutes"] = permutes;
    ctx->saved_data["in_shapes"] = in_shapes;
    ctx->saved_data["out_shapes"] = out_shapes;
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle<std::vector<at::Tensor>(
        at::TensorList, const OptionalTensors&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, c10::SymIntArrayRef)>("kt_regroup::permute_multi_embedding_vbe");
    return op.call(pooled_embs, indices, permutes, in_shapes, out_shapes, out_lengths);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& saved = ctx->saved_data;
    OptionalTensors grads;
    for (const at::Tensor& g : grad_outputs) {
      grads.push_back(g.defined() ? std::optional<at::Tensor>(g) : std::nullopt);
    }
    const std::vector<c10::SymInt> widths = saved.at("in_lengths").toSymIntVector();
    const std::vector<c10::SymInt> rows = saved.at("in_rows").toSymIntVector();
    OptionalTensors indices;
    const variable_list held = ctx->get_saved_variables();
    const c10::List<bool> present = saved.at("indices_present").toBoolList();
    for (size_t i = 0; i < held.size(); ++i) {
      indices.push_back(present[i] ? std::optional<at::Tensor>(held[i]) : std::nullopt);
    }
    static const auto op = op_handle<at::Tensor(
        const OptionalTensors&, const OptionalTensors&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::ScalarType)>(
        "kt_regroup::permute_multi_embedding_vbe_backward");
    const at::Tensor flat = op.call(
        grads, indices, saved.at("permutes").toTensor(), saved.at("in_shapes").toTensor(),
        saved.at("out_shapes").toTensor(), widths, rows, saved.at("dtype").toScalarType());
    variable_list out;  // per-input views of the one flat gradient, one op each
    c10::SymInt offset = flat.sym_storage_offset();
    for (size_t i = 0; i < rows.size(); ++i) {
      out.push_back(flat.as_strided_symint({rows[i], widths[i]}, {widths[i], 1}, offset));
      offset = offset + rows[i] * widths[i];
    }
    out.resize(out.size() + 5);  // indices, permutes, in_shapes, out_shapes, out_lengths
    return out;
  }
};

// VbeFunction::apply records no node where no input requires grad (or grad mode is off).
std::vector<at::Tensor> vbe_autograd(
    at::TensorList pooled_embs,
    const OptionalTensors& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths) {
  return VbeFunction::apply(pooled_embs, indices, permutes, in_shapes, out_shapes, out_lengths);
}

}  // namespace
}  // namespace kt_regroup

TORCH_LIBRARY_IMPL(kt_regroup, CompositeExplicitAutograd, m) {
  m.impl("permute_multi_embedding_vbe", TORCH_FN(kt_regroup::vbe_portable));
  m.impl("permute_multi_embedding_vbe_backward", TORCH_FN(kt_regroup::vbe_backward_portable));
}

TORCH_LIBRARY_IMPL(kt_regroup, CPU, m) {
  m.impl("permute_multi_embedding_vbe", TORCH_FN(kt_regroup::vbe_cpu));
  m.impl("permute_multi_embedding_vbe_backward", TORCH_FN(kt_regroup::vbe_backward_cpu));
}

TORCH_LIBRARY_IMPL(kt_regroup, Autograd, m) {
  m.impl("permute_multi_embedding_vbe", TORCH_FN(kt_regroup::vbe_autograd));
}
