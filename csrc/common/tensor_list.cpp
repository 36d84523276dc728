// Tensor lists as the kernels take them: validation of each list (device, dtype, layout, sizes,
// aliasing) before anything is written, flattened into raw pointers and element counts.
#include "common/tensor_list.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fastamp {
namespace {

// Whether two elements of `t` share memory. A dense tensor does not, a zero stride does; an
// as_strided view with strides (1, 2) over sizes (4, 4) overlaps without either. Sorted by stride,
// a layout is free of overlap when each stride exceeds the span of the dims below it (the usual
// case: slices, transposes, gaps); the rare interleaved layouts that fail this test are decided by
// listing their element offsets. Listing element offsets costs 8 bytes per element; beyond this
// size a layout that needs the listing is refused instead.
constexpr int64_t kMaxListed = int64_t{1} << 24;

// The storage offset (in elements) of every element of `t`, sorted.
std::vector<int64_t> element_offsets(const TensorMeta& t) {
  std::vector<int64_t> offsets{t.storage_offset};
  offsets.reserve(static_cast<size_t>(t.numel));
  for (int64_t d = 0; d < t.dim; ++d) {
    const int64_t size = t.size_data[d];
    if (size == 1) continue;
    const int64_t stride = t.stride_data[d];
    const size_t n = offsets.size();
    offsets.resize(n * static_cast<size_t>(size));
    for (int64_t k = size - 1; k >= 0; --k) {
      for (size_t j = 0; j < n; ++j)
        offsets[static_cast<size_t>(k) * n + j] = offsets[j] + k * stride;
    }
  }
  std::sort(offsets.begin(), offsets.end());
  return offsets;
}

bool elements_overlap(const TensorMeta& t) {
  if (t.numel <= 1 || t.dense()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim; ++d) {
    if (t.size_data[d] > 1) dims.emplace_back(t.stride_data[d], t.size_data[d]);
  }
  std::sort(dims.begin(), dims.end());
  // A zero stride repeats elements; otherwise, sorted by stride, the layout is free of overlap
  // when each stride exceeds the span of the dims below it.
  int64_t span = 0;  // largest offset reachable with the dims seen so far
  bool separable = true;
  for (const auto& [stride, size] : dims) {
    if (stride == 0) return true;
    if (stride <= span) {
      separable = false;
      break;
    }
    span += stride * (size - 1);
  }
  if (separable) return false;
  if (t.numel > kMaxListed) return true;
  const std::vector<int64_t> sorted = element_offsets(t);
  return std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
}

std::string dtype_list(std::initializer_list<ScalarType> allowed) {
  std::ostringstream os;
  bool first = true;
  for (auto d : allowed) {
    os << (first ? "" : ", ") << toString(d);
    first = false;
  }
  return os.str();
}

}  // namespace

MetaList MetaList::read(TensorList tensors) {
  MetaList out{tensors, {}};
  out.metas.reserve(tensors.size());
  for (const Tensor& t : tensors) out.metas.push_back(meta_of(t));
  return out;
}

FlatTensorList FlatTensorList::prepare(const MetaList& tensors, const char* op, const char* arg,
                                       const Device& device, bool writable,
                                       std::initializer_list<ScalarType> allowed) {
  FlatTensorList out;
  out.list_size_ = static_cast<int64_t>(tensors.size());
  out.items_.reserve(tensors.size());
  // Pass 1: validate everything; nothing is allocated or written until all tensors pass.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& t = tensors[i];
    FASTAMP_CHECK(t.defined, op, ": ", arg, "[", i,
                  "] is undefined (None); drop parameters without grads from the list");
    FASTAMP_CHECK(t.layout == kStrided, op, ": ", arg, "[", i, "] has layout ", t.layout,
                  "; expected a dense (strided) tensor. For sparse grads pass grad._values()");
    FASTAMP_CHECK(t.on(device), op, ": ", arg, "[", i, "] is on ", t.device(),
                  " but the op runs on ", device,
                  " (the device of its scalar tensors); group tensors by device");
    bool ok = false;
    for (auto d : allowed) ok = ok || (t.dtype == d);
    // NotImplementedError (a RuntimeError), as PyTorch's own dtype dispatch raises for a dtype
    // its kernel lacks ("... not implemented for 'ComplexFloat'").
    FASTAMP_CHECK_NOT_IMPLEMENTED(ok, op, ": ", arg, "[", i, "] has dtype ", t.dtype,
                                  " (not implemented for it); expected one of ",
                                  dtype_list(allowed));
    if (writable) {
      FASTAMP_CHECK(!elements_overlap(t), op, ": ", arg, "[", i,
                    "] is a view whose elements overlap in memory (e.g. from expand() or "
                    "as_strided()); it cannot be written in place. Pass a tensor with its own "
                    "storage (.clone())");
    }
  }
  // Pass 2: flatten.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& t = tensors[i];
    if (t.numel == 0) continue;
    void* data = t.data;
    if (!t.dense()) {
      Tensor src = contiguous_copy(tensors.tensors[i]);
      data = src.data_ptr();
      // Read-only lists keep the temporary alive only; writable ones also copy it back.
      out.staged_.emplace_back(writable ? tensors.tensors[i] : Tensor(), src);
    }
    out.items_.push_back(FlatTensor{data, t.numel, t.dtype, static_cast<int64_t>(i)});
  }
  return out;
}

void FlatTensorList::write_back() {
  for (auto& [dst, tmp] : staged_) {
    if (dst.defined()) copy_into(dst, tmp);
  }
}

namespace {

// How two tensors' memory relates (c10's MemOverlapStatus, less "full").
enum class Overlap { kNo, kPartial, kTooHard };

struct Conflict {
  size_t a, b;  // positions in the flattened sequence of tensors (a listed before b in memory)
  Overlap status;
};

// Whether `a` and `b`, whose byte bounds overlap, share an element.
Overlap overlap_status(const TensorMeta& a, const TensorMeta& b) {
  // Overlapping bounds: exact for dense tensors; strided views may still interleave.
  if (a.dense() && b.dense()) return Overlap::kPartial;
  // Strided views of one storage (e.g. x[::2] and x[1::2]): compare the elements.
  if (storage_base(a) == storage_base(b) && a.element_size() == b.element_size() &&
      a.numel <= kMaxListed && b.numel <= kMaxListed) {
    const std::vector<int64_t> oa = element_offsets(a);
    const std::vector<int64_t> ob = element_offsets(b);
    size_t i = 0, j = 0;
    while (i < oa.size() && j < ob.size()) {
      if (oa[i] == ob[j]) return Overlap::kPartial;
      (oa[i] < ob[j]) ? ++i : ++j;
    }
    return Overlap::kNo;
  }
  return Overlap::kTooHard;
}

// The first pair of tensors of `tensors` (pointers in caller order) that share memory, if any.
std::optional<Conflict> first_conflict(const std::vector<TensorMeta>& tensors) {
  struct Span {
    uintptr_t begin, end;  // bytes [begin, end) that bound the tensor's elements
    size_t pos;
    const TensorMeta* t;
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& t = tensors[i];
    if (!t.defined || t.numel == 0 || t.layout != kStrided) continue;
    int64_t lo = 0, hi = 0;  // element offsets reachable from data_ptr (strides may be < 0)
    for (int64_t d = 0; d < t.dim; ++d) {
      const int64_t reach = t.stride_data[d] * (t.size_data[d] - 1);
      (reach < 0 ? lo : hi) += reach;
    }
    const auto base = reinterpret_cast<uintptr_t>(t.data);
    const auto item = static_cast<uintptr_t>(t.element_size());
    spans.push_back(Span{base + static_cast<uintptr_t>(lo) * item,
                         base + static_cast<uintptr_t>(hi + 1) * item, i, &t});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size() && spans[j].begin < spans[i].end; ++j) {
      const Overlap status = overlap_status(*spans[i].t, *spans[j].t);
      if (status != Overlap::kNo) return Conflict{spans[i].pos, spans[j].pos, status};
    }
  }
  return std::nullopt;
}

}  // namespace

void check_disjoint(const char* op,
                    const std::vector<std::pair<const char*, const MetaList*>>& lists) {
  std::vector<TensorMeta> tensors;
  std::vector<std::pair<const char*, size_t>> names;  // (arg, index) of each tensor
  for (const auto& [arg, list] : lists) {
    for (size_t i = 0; i < list->size(); ++i) {
      tensors.push_back((*list)[i]);
      names.emplace_back(arg, i);
    }
  }
  const auto c = first_conflict(tensors);
  if (!c.has_value()) return;
  const auto& a = names[c->a];
  const auto& b = names[c->b];
  FASTAMP_CHECK(false, op, ": ", b.first, "[", b.second, "] and ", a.first, "[", a.second, "] ",
                c->status == Overlap::kTooHard ? "may share memory" : "share memory",
                "; both are written, so shared elements would be updated twice. Pass each "
                "tensor once, with its own storage (deduplicate the list, or .clone())");
}

std::vector<int64_t> find_shared_memory(TensorList tensors) {
  std::vector<TensorMeta> metas;
  metas.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& m = metas.emplace_back(meta_of(tensors[i]));
    if (m.defined && m.layout == kStrided && elements_overlap(m)) {
      return {static_cast<int64_t>(i), static_cast<int64_t>(i)};
    }
  }
  const auto c = first_conflict(metas);
  if (!c.has_value()) return {};
  return {static_cast<int64_t>(std::min(c->a, c->b)), static_cast<int64_t>(std::max(c->a, c->b))};
}

void check_scalar_tensor(const Tensor& tensor, const char* op, const char* arg,
                         const Device& device, ScalarType dtype, bool as_runtime_error) {
  const TensorMeta t = meta_of(tensor);
  FASTAMP_CHECK(t.defined, op, ": ", arg, " is undefined; expected a one-element ", toString(dtype),
                " tensor");
  FASTAMP_CHECK(t.on(device), op, ": ", arg, " is on ", t.device(), "; expected ", device);
  if (as_runtime_error) {
    // PyTorch's amp ops raise RuntimeError for a scalar tensor of the wrong dtype or size.
    FASTAMP_CHECK(t.dtype == dtype, op, ": ", arg, " has dtype ", t.dtype, "; expected ",
                  toString(dtype));
    FASTAMP_CHECK(t.numel == 1, op, ": ", arg, " has ", t.numel,
                  " elements; expected a one-element tensor");
  } else {
    FASTAMP_CHECK_TYPE(t.dtype == dtype, op, ": ", arg, " has dtype ", t.dtype, "; expected ",
                       toString(dtype));
    FASTAMP_CHECK_VALUE(t.numel == 1, op, ": ", arg, " has ", t.numel,
                        " elements; expected a one-element tensor");
  }
  FASTAMP_CHECK(t.layout == kStrided, op, ": ", arg, " must be a dense tensor");
}

}  // namespace fastamp
