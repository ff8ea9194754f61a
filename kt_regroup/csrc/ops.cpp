// The kt_regroup op library: every schema (but the private diagnostic ops', beside what
// they report), the plan ops, and the argument checks that every kernel runs before it
// touches data.
//
// Schemas are FBGEMM's where FBGEMM has the op, so each op is a drop-in replacement
// for its torch.ops.fbgemm namesake. They live here, in C++, so that a TorchScript or
// AOTInductor model runs where only this library is loaded (a C++ predictor); Python
// adds the fake kernels (kt_regroup/ops.py, named by set_python_module).

#include "kt_regroup.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>

namespace kt_regroup {
namespace {

// ---- argument checks ---------------------------------------------------------------------

std::string shape_str(c10::IntArrayRef shape) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

}  // namespace

void check_dense(const char* op, const char* name, int64_t i, const at::Tensor& t) {
  const c10::Layout layout = t.layout();
  if (C10_LIKELY(layout == at::kStrided && !t.is_nested() && !t.is_quantized())) return;
  const std::string what =
      std::string(name) + (i >= 0 ? "[" + std::to_string(i) + "]" : std::string());
  TORCH_CHECK_TYPE(
      !t.is_nested() && layout != at::kJagged, "kt_regroup.", op, ": ", what,
      " is a nested tensor; pass a dense (strided) tensor");
  TORCH_CHECK_TYPE(
      layout == at::kStrided, "kt_regroup.", op, ": ", what, " has layout ",
      layout == at::kSparse      ? "torch.sparse_coo"
      : layout == at::kSparseCsr ? "torch.sparse_csr"
      : layout == at::kSparseCsc ? "torch.sparse_csc"
      : layout == at::kSparseBsr ? "torch.sparse_bsr"
      : layout == at::kSparseBsc ? "torch.sparse_bsc"
      : layout == at::kMkldnn    ? "torch._mkldnn"
                                 : "other than torch.strided",
      "; pass a dense (strided) tensor (to_dense() converts it)");
  TORCH_CHECK_TYPE(
      !t.is_quantized(), "kt_regroup.", op, ": ", what, " is quantized (", t.scalar_type(),
      "); pass a dense tensor of a plain dtype (dequantize() converts it)");
}

void check_output_elements(
    const char* op, const char* name, c10::IntArrayRef lengths, int64_t batch) {
  // Past this, the bytes of a 16-byte dtype overflow int64: no memory holds it.
  constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max() / 16;
  for (size_t j = 0; j < lengths.size(); ++j) {
    TORCH_CHECK_VALUE(
        batch <= 0 || lengths[j] <= kMaxElements / batch, "kt_regroup.", op, ": ", name, "[", j,
        "] = ", lengths[j], " with a batch of ", batch,
        " is more elements than any memory holds (the bytes overflow int64)");
  }
}

namespace {

void check_tensor_list(
    const char* op,
    const char* name,
    const TensorPtrs& tensors,
    bool same_dtype = true,
    bool same_batch = true) {
  const auto first_it = std::find_if(
      tensors.begin(), tensors.end(), [](const at::Tensor* t) { return t != nullptr; });
  TORCH_CHECK_VALUE(first_it != tensors.end(), "kt_regroup.", op, ": ", name, " is empty");
  const size_t i0 = first_it - tensors.begin();
  const at::Tensor& first = **first_it;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i] == nullptr) continue;
    const at::Tensor& t = *tensors[i];
    check_dense(op, name, static_cast<int64_t>(i), t);
    TORCH_CHECK_VALUE(
        t.dim() == 2, "kt_regroup.", op, ": ", name, "[", i,
        "] must be 2-D [batch, width], got shape ", shape_str(t.sizes()));
    TORCH_CHECK_VALUE(
        t.device() == first.device(), "kt_regroup.", op, ": ", name, "[", i, "] is on ", t.device(),
        " but ", name, "[", i0, "] is on ", first.device(), "; all must be on one device");
    TORCH_CHECK_TYPE(
        !same_dtype || t.scalar_type() == first.scalar_type(), "kt_regroup.", op, ": ", name, "[",
        i, "] is ", t.scalar_type(), " but ", name, "[", i0, "] is ", first.scalar_type(),
        "; all must have one dtype (permute_multi_embedding_to with a dtype casts mixed inputs)");
    TORCH_CHECK_VALUE(
        !same_batch || t.size(0) == first.size(0), "kt_regroup.", op, ": ", name, "[", i,
        "] has batch size ", t.size(0), " but ", name, "[", i0, "] has ", first.size(0),
        "; all must have the same batch size");
  }
}

// Shapes and dtypes of the metadata; `data` is the device the kernel computes on.
void check_metadata(
    const char* op,
    const PlanArgs& args,
    size_t n_in,
    size_t n_out,
    std::optional<c10::Device> data) {
  const at::Tensor &permutes = args.permutes, &in_shapes = args.in_shapes,
                   &out_shapes = args.out_shapes;
  TORCH_CHECK_VALUE(
      permutes.dim() == 2 && permutes.size(1) == kPermuteColumns, "kt_regroup.", op,
      ": permutes must have shape [n, ", kPermuteColumns,
      "] (in_tensor, out_tensor, in_offset, out_offset, length, next), got ",
      shape_str(permutes.sizes()));
  const std::pair<const char*, const at::Tensor*> named[] = {
      {"permutes", &permutes}, {"in_shapes", &in_shapes}, {"out_shapes", &out_shapes}};
  for (const auto& [name, t] : named) {
    check_dense(op, name, -1, *t);
    TORCH_CHECK_TYPE(
        t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, "kt_regroup.", op, ": ",
        name, " must be int32 or int64, got ", t->scalar_type());
    // Metadata on meta next to real data has no values to check or read.
    TORCH_CHECK_VALUE(
        !t->is_meta() || !data.has_value() || data->is_meta(), "kt_regroup.", op, ": ", name,
        " is on meta but the data is on ", *data, "; metadata and data must be on real devices");
  }
  TORCH_CHECK_VALUE(
      in_shapes.dim() == 1 && in_shapes.numel() == static_cast<int64_t>(n_in), "kt_regroup.", op,
      ": in_shapes must have one entry per input tensor (", n_in, "), got shape ",
      shape_str(in_shapes.sizes()));
  TORCH_CHECK_VALUE(
      out_shapes.dim() == 1 && out_shapes.numel() == static_cast<int64_t>(n_out), "kt_regroup.", op,
      ": out_shapes must have one entry per output (", n_out, "), got shape ",
      shape_str(out_shapes.sizes()));
}

// An int32/int64 metadata tensor of any device and strides, read as int64 on the host
// (on the CPU without a copy: this runs on every call).
template <typename index_t>
std::vector<int64_t> read_values_typed(const at::Tensor& t) {
  std::vector<int64_t> out(t.numel());
  const index_t* p = t.const_data_ptr<index_t>();
  if (t.is_contiguous()) {
    std::copy(p, p + out.size(), out.begin());
  } else {  // any strides: walk the rows (1-D or [n, 6])
    const int64_t cols = t.dim() == 2 ? t.size(1) : 1;
    const int64_t s0 = t.dim() > 0 ? t.stride(0) : 0, s1 = t.dim() == 2 ? t.stride(1) : 0;
    for (size_t k = 0; k < out.size(); ++k) {
      out[k] = p[(k / cols) * s0 + (k % cols) * s1];
    }
  }
  return out;
}

std::vector<int64_t> read_values(const at::Tensor& t) {
  const at::Tensor host = t.is_cpu() ? t : t.cpu();
  return host.scalar_type() == at::kInt ? read_values_typed<int32_t>(host)
                                        : read_values_typed<int64_t>(host);
}

void check_declared(
    const char* op,
    const char* tensor_name,
    const std::vector<int64_t>& declared,
    const char* actual_name,
    const std::vector<int64_t>& actual) {
  for (size_t i = 0; i < actual.size(); ++i) {
    TORCH_CHECK_VALUE(
        actual[i] >= 0, "kt_regroup.", op, ": ", actual_name, "[", i, "] is negative (", actual[i],
        ")");
    TORCH_CHECK_VALUE(
        declared[i] == actual[i], "kt_regroup.", op, ": ", tensor_name, "[", i, "]=", declared[i],
        " but ", actual_name, "[", i, "]=", actual[i]);
  }
}

// offset + length as a reader expects it, for any int64 offset and length >= 0.
std::string end_of(int64_t offset, int64_t length) {
  if (offset < 0) return std::to_string(offset + length);
  return std::to_string(static_cast<uint64_t>(offset) + static_cast<uint64_t>(length));
}

// Every row inside its input and output; rows merged where they continue each other.
std::vector<Segment> check_rows(
    const char* op,
    const at::Tensor& permutes,
    const std::vector<int64_t>& in_widths,
    const std::vector<int64_t>& out_widths) {
  const std::vector<int64_t> flat = read_values(permutes);
  const int64_t n_in = static_cast<int64_t>(in_widths.size());
  const int64_t n_out = static_cast<int64_t>(out_widths.size());
  std::vector<Segment> segments;
  segments.reserve(flat.size() / kPermuteColumns);
  for (size_t r = 0; r < flat.size() / kPermuteColumns; ++r) {
    const int64_t* row = flat.data() + r * kPermuteColumns;
    const int64_t in_t = row[0], out_t = row[1], in_off = row[2], out_off = row[3], length = row[4];
    TORCH_CHECK_INDEX(
        in_t >= 0 && in_t < n_in, "kt_regroup.", op, ": permutes[", r, "] in_tensor=", in_t,
        " is out of range [0, ", n_in, ")");
    TORCH_CHECK_INDEX(
        out_t >= 0 && out_t < n_out, "kt_regroup.", op, ": permutes[", r, "] out_tensor=", out_t,
        " is out of range [0, ", n_out, ")");
    TORCH_CHECK_VALUE(
        length >= 0, "kt_regroup.", op, ": permutes[", r, "] has negative length ", length);
    // Differences, not sums: no int64 overflow for any value.
    TORCH_CHECK_INDEX(
        in_off >= 0 && length <= in_widths[in_t] - in_off, "kt_regroup.", op, ": permutes[", r,
        "] reads columns [", in_off, ", ", end_of(in_off, length), ") of input ", in_t,
        ", which has ", in_widths[in_t], " columns");
    TORCH_CHECK_INDEX(
        out_off >= 0 && length <= out_widths[out_t] - out_off, "kt_regroup.", op, ": permutes[", r,
        "] writes columns [", out_off, ", ", end_of(out_off, length), ") of output ", out_t,
        ", which has ", out_widths[out_t], " columns");
    if (length == 0) continue;
    if (!segments.empty()) {
      Segment& last = segments.back();
      if (last.in_t == in_t && last.out_t == out_t && last.in_off + last.length == in_off &&
          last.out_off + last.length == out_off) {
        last.length += length;
        continue;
      }
    }
    segments.push_back(Segment{in_t, out_t, in_off, out_off, length});
  }
  return segments;
}

// Whether the segments write every column of every output exactly once, in order
// (then outputs need no zero fill).
bool segments_tile_outputs(const std::vector<Segment>& segments, c10::IntArrayRef out_lengths) {
  // Sufficient test: per output, segments arrive in increasing, gap-free order.
  std::vector<int64_t> next(out_lengths.size(), 0);
  for (const Segment& s : segments) {
    if (s.out_off != next[s.out_t]) return false;
    next[s.out_t] += s.length;
  }
  for (size_t j = 0; j < out_lengths.size(); ++j) {
    if (next[j] != out_lengths[j]) return false;
  }
  return true;
}

// grad_outputs[j] (when given) is [batch_size, width].
void check_grad_shape(
    const char* op, const TensorPtrs& grads, size_t j, int64_t batch_size, int64_t width) {
  TORCH_CHECK_VALUE(
      grads[j] == nullptr || (grads[j]->size(0) == batch_size && grads[j]->size(1) == width),
      "kt_regroup.", op, ": grad_outputs[", j, "] has shape ",
      grads[j] ? shape_str(grads[j]->sizes()) : "", ", expected (", batch_size, ", ", width, ")");
}

// The checks that read the plan's values (after the others), as a plan: the declared
// widths against the tensors' and the call's, and every permute row.
std::shared_ptr<CheckedPlan> check_values(
    const Call& call, const PlanArgs& args, c10::IntArrayRef lengths) {
  const char* op = call.op;
  auto plan = std::make_shared<CheckedPlan>();
  std::vector<int64_t> in_widths(lengths.begin(), lengths.end());
  if (call.kind == Kind::kBackward) {
    plan->out_widths = read_values(args.out_shapes);
    for (size_t j = 0; j < call.tensors.size(); ++j) {
      TORCH_CHECK_VALUE(
          plan->out_widths[j] >= 0, "kt_regroup.", op, ": out_shapes[", j, "] is negative (",
          plan->out_widths[j], ")");
      check_grad_shape(op, call.tensors, j, call.batch_size, plan->out_widths[j]);
    }
    check_declared(op, "in_shapes", read_values(args.in_shapes), "in_lengths", in_widths);
  } else {
    plan->out_widths = std::move(in_widths);
    check_declared(op, "out_shapes", read_values(args.out_shapes), "out_lengths", plan->out_widths);
    in_widths.clear();
    for (const at::Tensor* t : call.tensors) in_widths.push_back(t->size(1));
    const std::vector<int64_t> in_declared = read_values(args.in_shapes);
    for (size_t i = 0; i < in_widths.size(); ++i) {
      TORCH_CHECK_VALUE(
          in_declared[i] == in_widths[i], "kt_regroup.", op, ": in_shapes[", i,
          "]=", in_declared[i], " but pooled_embs[", i, "] has ", in_widths[i], " columns");
    }
  }
  plan->segments = check_rows(op, args.permutes, in_widths, plan->out_widths);
  plan->tiled = segments_tile_outputs(plan->segments, plan->out_widths);
  return plan;
}

// The per-thread cache of check(): the last few checked
// plans, each with the exact bytes of its metadata tensors and the input widths it was
// checked against (its output widths are the values of out_shapes, which the checks
// compared with out_lengths or the upstream gradients). One plan serves both directions.
class PlanCache {
 public:
  // Metadata past this many bytes is not cached (its checks dwarf nothing).
  static constexpr size_t kMaxBytes = size_t(1) << 20;
  static constexpr size_t kEntries = 8;

  // Whether the call can be looked up: its metadata are readable CPU memory in order.
  static bool cacheable(const at::Tensor* const (&meta)[3]) {
    size_t bytes = 0;
    for (const at::Tensor* t : meta) {
      if (!t->device().is_cpu() || t->is_meta() || !t->is_contiguous() || t->is_neg() ||
          t->is_conj()) {
        return false;
      }
      bytes += t->nbytes();
    }
    return bytes <= kMaxBytes;
  }

  // The plan of these metadata values and input widths; `out_widths` (the forward's
  // out_lengths), when given, must be the plan's too.
  std::shared_ptr<const CheckedPlan> find(
      const at::Tensor* const (&meta)[3],
      c10::IntArrayRef in_widths,
      std::optional<c10::IntArrayRef> out_widths) const {
    for (const Entry& e : entries_) {
      if (e.plan && e.matches(meta, in_widths, out_widths)) return e.plan;
    }
    return nullptr;
  }

  void add(
      const at::Tensor* const (&meta)[3],
      c10::IntArrayRef in_widths,
      std::shared_ptr<const CheckedPlan> plan) {
    Entry& e = entries_[next_];
    next_ = (next_ + 1) % kEntries;
    for (size_t k = 0; k < 3; ++k) {
      const at::Tensor& t = *meta[k];
      e.dtypes[k] = t.scalar_type();
      e.numel[k] = t.numel();
      const char* p = static_cast<const char*>(t.const_data_ptr());
      e.bytes[k].assign(p, p + t.nbytes());
    }
    e.in_widths.assign(in_widths.begin(), in_widths.end());
    e.plan = std::move(plan);
  }

  static PlanCache& get() {
    thread_local PlanCache cache;
    return cache;
  }

 private:
  struct Entry {
    c10::ScalarType dtypes[3];
    int64_t numel[3];
    std::vector<char> bytes[3];
    std::vector<int64_t> in_widths;
    std::shared_ptr<const CheckedPlan> plan;

    bool matches(
        const at::Tensor* const (&meta)[3],
        c10::IntArrayRef widths,
        std::optional<c10::IntArrayRef> out_widths) const {
      if (!std::equal(in_widths.begin(), in_widths.end(), widths.begin(), widths.end()) ||
          (out_widths && !std::equal(
                             plan->out_widths.begin(), plan->out_widths.end(), out_widths->begin(),
                             out_widths->end()))) {
        return false;
      }
      for (size_t k = 0; k < 3; ++k) {
        const at::Tensor& t = *meta[k];
        if (t.scalar_type() != dtypes[k] || t.numel() != numel[k] ||
            (!bytes[k].empty() &&
             std::memcmp(t.const_data_ptr(), bytes[k].data(), bytes[k].size()) != 0)) {
          return false;
        }
      }
      return true;
    }
  };
  Entry entries_[kEntries];
  size_t next_ = 0;
};

// The caller-owned outputs of a permute_multi_embedding_into call (2-D, batch, dtype,
// device, unit column stride, rows that share no memory, no overlap by address with the
// inputs or each other whatever their Storage, no inference tensor outside inference
// mode); reads no tensor data. Returns their widths (the call's out_lengths).
PerTensor<int64_t> check_into_outs(const TensorPtrs& pooled_embs, at::TensorList outs) {
  const char* op = "permute_multi_embedding_into";
  TORCH_CHECK_VALUE(!pooled_embs.empty(), "kt_regroup.", op, ": pooled_embs is empty");
  const at::Tensor& first = *pooled_embs[0];
  PerTensor<int64_t> widths;
  for (size_t j = 0; j < outs.size(); ++j) {
    const at::Tensor& t = outs[j];
    check_dense(op, "outs", static_cast<int64_t>(j), t);
    TORCH_CHECK_VALUE(
        t.dim() == 2 && t.size(0) == first.size(0), "kt_regroup.", op, ": outs[", j,
        "] must have shape (", first.size(0), ", width), got shape ", shape_str(t.sizes()));
    TORCH_CHECK_TYPE(
        t.scalar_type() == first.scalar_type(), "kt_regroup.", op, ": outs[", j, "] is ",
        t.scalar_type(), " but pooled_embs[0] is ", first.scalar_type());
    TORCH_CHECK_VALUE(
        t.device() == first.device(), "kt_regroup.", op, ": outs[", j, "] is on ", t.device(),
        " but pooled_embs[0] is on ", first.device());
    TORCH_CHECK_VALUE(
        t.size(1) <= 1 || t.stride(1) == 1, "kt_regroup.", op, ": outs[", j,
        "] must have unit column stride, got strides (", t.stride(0), ", ", t.stride(1), ")");
    TORCH_CHECK(
        !t.is_inference() || c10::InferenceMode::is_enabled(), "kt_regroup.", op, ": outs[", j,
        "] is an inference tensor: Inplace update to inference tensor outside InferenceMode "
        "is not allowed (clone() it to get a normal tensor)");
    widths.push_back(t.size(1));
  }
  // Every element of an output is written once: rows that share memory (a stride-0
  // expand, or a row stride below the width) would make the result depend on the order
  // of the writes. `copy_` refuses the first kind too.
  for (size_t j = 0; j < outs.size(); ++j) {
    const at::Tensor& t = outs[j];
    TORCH_CHECK_VALUE(
        t.size(0) <= 1 || t.size(1) == 0 || t.stride(0) >= t.size(1), "kt_regroup.", op, ": outs[",
        j, "] has strides (", t.stride(0), ", ", t.stride(1), ") for shape ", shape_str(t.sizes()),
        ", so more than one element of the written-to tensor refers to a "
        "single memory location; pass a tensor whose elements have their own memory (e.g. clone() "
        "it)");
  }
  // Address ranges, whatever the Storage: two tensors of different Storage objects share
  // memory through torch.from_numpy of one array, dlpack or torch.frombuffer.
  // Conservative: a strided view counts as its whole span.
  auto span = [](const at::Tensor& t) {
    const auto lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    uintptr_t hi = lo + t.element_size();
    for (int64_t d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * t.stride(d) * t.element_size();
    return std::make_pair(lo, hi);
  };
  auto overlaps = [&](const at::Tensor& a, const at::Tensor& b) {
    // Meta tensors (no data) never overlap anything.
    if (a.numel() == 0 || b.numel() == 0 || !a.const_data_ptr() || !b.const_data_ptr())
      return false;
    const auto [alo, ahi] = span(a);
    const auto [blo, bhi] = span(b);
    return alo < bhi && blo < ahi;
  };
  for (size_t j = 0; j < outs.size(); ++j) {
    for (size_t i = 0; i < pooled_embs.size(); ++i) {
      TORCH_CHECK_VALUE(
          !overlaps(outs[j], *pooled_embs[i]), "kt_regroup.", op, ": outs[", j,
          "] overlaps pooled_embs[", i, "] in memory; outputs must not alias the inputs");
    }
    for (size_t k = 0; k < j; ++k) {
      TORCH_CHECK_VALUE(
          !overlaps(outs[j], outs[k]), "kt_regroup.", op, ": outs[", j, "] overlaps outs[", k,
          "] in memory; outputs must not alias each other");
    }
  }
  return widths;
}

}  // namespace

std::shared_ptr<const CheckedPlan> check(const Call& call, const PlanArgs& args) {
  const char* op = call.op;
  const TensorPtrs& ts = call.tensors;
  const bool backward = call.kind == Kind::kBackward;
  const bool same_batch = call.kind != Kind::kVbe;
  PerTensor<int64_t> into_widths;
  if (call.kind == Kind::kInto) into_widths = check_into_outs(ts, call.outs);
  const c10::IntArrayRef lengths = call.kind == Kind::kInto ? into_widths : args.lengths;
  const char* lengths_name = backward ? "in_lengths" : "out_lengths";
  // Without the plan's values: on a device they would be copied to the host, a wait.
  const bool values = !call.device_kernel || args.on_host();
  std::optional<c10::Device> device;
  if (!backward || std::any_of(ts.begin(), ts.end(), [](const at::Tensor* t) { return t; })) {
    check_tensor_list(
        op, backward ? "grad_outputs" : "pooled_embs", ts, call.kind != Kind::kCast, same_batch);
    device = gradients_device(ts, args.permutes);
  }
  const int64_t batch = backward ? call.batch_size : ts[0]->size(0);
  if (backward) {
    TORCH_CHECK_VALUE(batch >= 0, "kt_regroup.", op, ": batch_size is negative (", batch, ")");
  }
  if (!values) {  // the value checks find these otherwise
    for (size_t j = 0; backward && j < ts.size(); ++j) {
      TORCH_CHECK_VALUE(
          !ts[j] || ts[j]->size(0) == batch, "kt_regroup.", op, ": grad_outputs[", j, "] has ",
          ts[j] ? ts[j]->size(0) : 0, " rows, expected batch_size ", batch);
    }
    for (size_t j = 0; j < lengths.size(); ++j) {
      TORCH_CHECK_VALUE(
          lengths[j] >= 0, "kt_regroup.", op, ": ", lengths_name, "[", j, "] is negative (",
          lengths[j], ")");
    }
  }
  const size_t n_in = backward ? lengths.size() : ts.size();
  const size_t n_out = backward ? ts.size() : lengths.size();
  // A forward that reads the plan's values checks the metadata before the sizes.
  const bool metadata_first = values && !backward;
  if (metadata_first) check_metadata(op, args, n_in, n_out, device);
  if (same_batch) check_output_elements(op, lengths_name, lengths, batch);
  if (!metadata_first) check_metadata(op, args, n_in, n_out, device);
  if (!values) return nullptr;
  const at::Tensor* const meta[3] = {&args.permutes, &args.in_shapes, &args.out_shapes};
  if (!same_batch || !PlanCache::cacheable(meta)) return check_values(call, args, lengths);
  PerTensor<int64_t> in_widths;
  if (!backward) {
    for (const at::Tensor* t : ts) in_widths.push_back(t->size(1));
  }
  const c10::IntArrayRef widths = backward ? lengths : c10::IntArrayRef(in_widths);
  PlanCache& cache = PlanCache::get();
  if (auto plan = cache.find(meta, widths, backward ? std::nullopt : std::optional(lengths))) {
    for (size_t j = 0; backward && j < ts.size(); ++j) {
      check_grad_shape(op, ts, j, batch, plan->out_widths[j]);
    }
    return plan;
  }
  std::shared_ptr<const CheckedPlan> plan = check_values(call, args, lengths);
  cache.add(meta, widths, plan);
  return plan;
}

TensorPtrs grad_pointers(
    const c10::List<std::optional<at::Tensor>>& grad_outputs, HeldTensors& held) {
  held.assign(grad_outputs.begin(), grad_outputs.end());
  TensorPtrs ptrs(held.size(), nullptr);
  for (size_t j = 0; j < held.size(); ++j) {
    if (held[j].has_value() && held[j]->defined()) ptrs[j] = &*held[j];
  }
  return ptrs;
}

namespace {

// ---- the plan: torchrec's _kt_regroup_arguments ------------------------------------------

using Names = std::vector<std::vector<std::string>>;

// Plans are int32 (torchrec's format): every width, offset, total and row index fits.
constexpr int64_t kMaxPlanValue = std::numeric_limits<int32_t>::max();

// A key in an error message: quoted, control bytes as \xNN (a NUL would end the message
// where Python reads it as a C string).
std::string quoted(const std::string& key) {
  std::string s = "'";
  for (const char c : key) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      constexpr char hex[] = "0123456789abcdef";
      s += {'\\', 'x', hex[(c >> 4) & 0xf], hex[c & 0xf]};
    } else {
      s += c;
    }
  }
  return s + "'";
}

std::string preview(const std::vector<std::string>& keys, size_t limit = 8) {
  std::ostringstream s;
  s << "[";
  for (size_t k = 0; k < std::min(keys.size(), limit); ++k) s << (k ? ", " : "") << quoted(keys[k]);
  if (keys.size() > limit) s << ", ... (" << keys.size() << " keys)";
  s << "]";
  return s.str();
}

struct Rows {
  std::vector<std::array<int64_t, kPermuteColumns>> rows;
  std::vector<int64_t> in_lengths;
  std::vector<int64_t> out_lengths;
};

// Shared by kt_regroup_arguments and regroup_keyed_tensor (which reads pooled_embs[0]).
void check_has_inputs(const Names& keys) {
  TORCH_CHECK_VALUE(!keys.empty(), "kt_regroup: no input tensors given (keys is empty)");
}

// One row per group entry; duplicated keys are chained through column 5 the way
// torchrec's _kt_regroup_arguments does (first occurrence -> index of the second; later
// occurrences -> minus the index of the next one, the last -> minus the row count).
Rows build_rows(
    const Names& keys, const std::vector<std::vector<int64_t>>& lengths, const Names& groups) {
  check_has_inputs(keys);
  TORCH_CHECK_VALUE(
      keys.size() == lengths.size(), "kt_regroup: got keys for ", keys.size(),
      " tensors but lengths for ", lengths.size());
  struct Where {
    int64_t tensor, offset, width;
  };
  std::unordered_map<std::string_view, Where> where;
  Rows out;
  for (size_t t = 0; t < keys.size(); ++t) {
    TORCH_CHECK_VALUE(
        keys[t].size() == lengths[t].size(), "kt_regroup: input ", t, " has ", keys[t].size(),
        " keys but ", lengths[t].size(), " lengths");
    int64_t offset = 0;
    for (size_t k = 0; k < keys[t].size(); ++k) {
      const std::string& key = keys[t][k];
      const int64_t width = lengths[t][k];
      TORCH_CHECK_VALUE(
          width >= 0, "kt_regroup: key ", quoted(key), " of input ", t, " has negative width ",
          width);
      TORCH_CHECK_VALUE(
          width <= kMaxPlanValue, "kt_regroup: key ", quoted(key), " of input ", t, " has width ",
          width, ", more than an int32 plan holds (", kMaxPlanValue, ")");
      const auto [it, inserted] = where.emplace(key, Where{int64_t(t), offset, width});
      TORCH_CHECK_VALUE(
          inserted, "kt_regroup: key ", quoted(key), " appears in input ", it->second.tensor,
          " and input ", t, "; a key must name exactly one column block (ambiguous)");
      offset += width;  // both <= 2^31 - 1: no int64 overflow
      TORCH_CHECK_VALUE(
          offset <= kMaxPlanValue, "kt_regroup: input ", t, " has ", offset, " columns up to key ",
          quoted(key), " (width ", width, "), more than an int32 plan holds (", kMaxPlanValue, ")");
    }
    out.in_lengths.push_back(offset);
  }
  size_t total = 0;
  for (const auto& g : groups) total += g.size();
  TORCH_CHECK_VALUE(
      total <= static_cast<size_t>(kMaxPlanValue), "kt_regroup: the groups name ", total,
      " keys, more than an int32 plan holds (", kMaxPlanValue, ")");
  out.rows.reserve(total);
  std::unordered_map<std::string_view, int64_t> last_seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    int64_t out_off = 0;
    for (const std::string& key : groups[g]) {
      const auto it = where.find(key);
      if (it == where.end()) {
        std::ostringstream looked;
        for (size_t t = 0; t < keys.size(); ++t)
          looked << (t ? "; " : "") << "input " << t << ": " << preview(keys[t]);
        TORCH_CHECK_INDEX(
            false, "kt_regroup: group ", g, " asks for key ", quoted(key),
            ", which is in none of the ", keys.size(), " inputs (looked in: ", looked.str(), ")");
      }
      const Where& w = it->second;
      const int64_t idx = static_cast<int64_t>(out.rows.size());
      int64_t next = 0;
      const auto seen = last_seen.find(key);
      if (seen == last_seen.end()) {
        last_seen.emplace(key, idx);
      } else {
        const int64_t prev = seen->second;
        if (prev >= 0) {
          out.rows[prev][5] = idx;
        } else {
          out.rows[-prev][5] = -idx;
        }
        seen->second = -idx;
        next = -static_cast<int64_t>(total);
      }
      out.rows.push_back({w.tensor, int64_t(g), w.offset, out_off, w.width, next});
      out_off += w.width;
      TORCH_CHECK_VALUE(
          out_off <= kMaxPlanValue, "kt_regroup: group ", g, " has ", out_off,
          " columns up to key ", quoted(key), " (width ", w.width,
          "), more than an int32 plan holds (", kMaxPlanValue, ")");
    }
    out.out_lengths.push_back(out_off);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>> kt_regroup_arguments(
    const at::Tensor& embs,
    const Names& keys,
    const std::vector<std::vector<int64_t>>& lengths,
    const Names& groups) {
  const Rows plan = build_rows(keys, lengths, groups);  // every value fits int32
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor permutes = at::empty({int64_t(plan.rows.size()), kPermuteColumns}, i32);
  int32_t* p = permutes.mutable_data_ptr<int32_t>();
  for (const auto& row : plan.rows) {
    for (int64_t v : row) *p++ = static_cast<int32_t>(v);
  }
  auto int_tensor = [&](const std::vector<int64_t>& v) {
    at::Tensor t = at::empty({int64_t(v.size())}, i32);
    std::copy(v.begin(), v.end(), t.mutable_data_ptr<int32_t>());
    return t;
  };
  at::Tensor in_shapes = int_tensor(plan.in_lengths);
  at::Tensor out_shapes = int_tensor(plan.out_lengths);
  if (!embs.device().is_cpu()) {
    permutes = permutes.to(embs.device());
    in_shapes = in_shapes.to(embs.device());
    out_shapes = out_shapes.to(embs.device());
  }
  return {permutes, in_shapes, out_shapes, plan.out_lengths};
}

// Composite: kt_regroup_arguments, then permute_multi_embedding (whose kernels and
// autograd apply). Under FakeTensorMode both steps use their fake kernels.
std::vector<at::Tensor> regroup_keyed_tensor(
    at::TensorList pooled_embs,
    const Names& keys,
    const std::vector<std::vector<int64_t>>& lengths,
    const Names& groups) {
  TORCH_CHECK_VALUE(
      pooled_embs.size() == keys.size(), "kt_regroup.regroup_keyed_tensor: ", pooled_embs.size(),
      " tensors but keys for ", keys.size());
  check_has_inputs(keys);
  static const auto arguments_op =
      op_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>>(
          const at::Tensor&, const Names&, const std::vector<std::vector<int64_t>>&, const Names&)>(
          "kt_regroup::kt_regroup_arguments");
  static const auto permute_op = op_handle<std::vector<at::Tensor>(
      at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      c10::SymIntArrayRef)>("kt_regroup::permute_multi_embedding");
  const auto [permutes, in_shapes, out_shapes, out_lengths] =
      arguments_op.call(pooled_embs[0], keys, lengths, groups);
  return permute_op.call(
      pooled_embs, permutes, in_shapes, out_shapes, c10::fromIntArrayRefSlow(out_lengths));
}

}  // namespace
}  // namespace kt_regroup

// The torch version this library was compiled against (kt_regroup/ops.py warns when the
// running torch differs).
extern "C" const char* kt_regroup_built_with_torch() {
  return TORCH_VERSION;
}

TORCH_LIBRARY(kt_regroup, m) {
  // Fake kernels are registered by this Python module; torch imports it when it needs them.
  m.set_python_module("kt_regroup.ops");
  m.def(
      "permute_multi_embedding(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
      "Tensor out_shapes, SymInt[] out_lengths) -> Tensor[]");
  m.def(
      "permute_multi_embedding_backward(Tensor?[] grad_outputs, Tensor permutes, "
      "Tensor in_shapes, Tensor out_shapes, SymInt[] in_lengths, SymInt batch_size, "
      "ScalarType dtype) -> Tensor[]");
  m.def(
      "permute_multi_embedding_to(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
      "Tensor out_shapes, SymInt[] out_lengths, ScalarType? dtype=None) -> Tensor[]");
  m.def(
      "permute_multi_embedding_into(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
      "Tensor out_shapes, Tensor(a!)[] outs) -> ()");
  m.def(
      "kt_regroup_arguments(Tensor embs, str[][] keys, int[][] lengths, str[][] groups) "
      "-> (Tensor, Tensor, Tensor, int[])");
  m.def(
      "regroup_keyed_tensor(Tensor[] pooled_embs, str[][] keys, int[][] lengths, "
      "str[][] groups) -> Tensor[]");
  m.def(
      "permute_multi_embedding_vbe(Tensor[] pooled_embs, Tensor?[] indices, Tensor permutes, "
      "Tensor in_shapes, Tensor out_shapes, SymInt[] out_lengths) -> Tensor[]");
  m.def(
      "permute_multi_embedding_vbe_backward(Tensor?[] grad_outputs, Tensor?[] indices, "
      "Tensor permutes, Tensor in_shapes, Tensor out_shapes, SymInt[] in_lengths, "
      "SymInt[] in_rows, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kt_regroup, CompositeExplicitAutograd, m) {
  m.impl("kt_regroup_arguments", TORCH_FN(kt_regroup::kt_regroup_arguments));
}

TORCH_LIBRARY_IMPL(kt_regroup, CompositeImplicitAutograd, m) {
  m.impl("regroup_keyed_tensor", TORCH_FN(kt_regroup::regroup_keyed_tensor));
}

namespace {

// Any op of the library called with a nested tensor (strided or jagged): a TypeError
// naming the argument, where the dispatcher would say no kernel exists.
void reject_nested(const c10::OperatorHandle& op, c10::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  const std::string name = op.schema().name().substr(op.schema().name().find("::") + 2);
  for (size_t a = 0; a < args.size(); ++a) {
    const c10::IValue& v = (*stack)[first + a];
    if (v.isTensor()) {
      kt_regroup::check_dense(name.c_str(), args[a].name().c_str(), -1, v.toTensor());
    } else if (v.isList()) {
      const c10::List<c10::IValue> list = v.toList();
      for (size_t i = 0; i < list.size(); ++i) {
        const c10::IValue e = list.get(i);
        if (e.isTensor()) {
          kt_regroup::check_dense(
              name.c_str(), args[a].name().c_str(), static_cast<int64_t>(i), e.toTensor());
        }
      }
    }
  }
  TORCH_CHECK_TYPE(false, "kt_regroup.", name, ": nested tensors are not supported");
}

}  // namespace

TORCH_LIBRARY_IMPL(kt_regroup, CompositeImplicitAutogradNestedTensor, m) {
  for (const char* op :
       {"permute_multi_embedding", "permute_multi_embedding_backward", "permute_multi_embedding_to",
        "permute_multi_embedding_into", "kt_regroup_arguments", "regroup_keyed_tensor",
        "permute_multi_embedding_vbe", "permute_multi_embedding_vbe_backward"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&reject_nested>());
  }
}
