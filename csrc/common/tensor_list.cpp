// Tensor lists as the kernels take them: validation of each list (device, dtype, layout, sizes,
// aliasing) before anything is written, flattened into raw pointers and element counts.
#include "common/tensor_list.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fastamp {
namespace {

// Whether two elements of `t` share memory. at::has_internal_overlap only answers for dense
// tensors and zero strides ("too hard" otherwise): an as_strided view with strides (1, 2) over
// sizes (4, 4) overlaps without either. Sorted by stride, a layout is free of overlap when each
// stride exceeds the span of the dims below it (the usual case: slices, transposes, gaps); the
// rare interleaved layouts that fail this test are decided by listing their element offsets.
// Listing element offsets costs 8 bytes per element; beyond this size a layout that needs the
// listing is refused instead.
constexpr int64_t kMaxListed = int64_t{1} << 24;

// The storage offset (in elements) of every element of `t`, on the CPU.
at::Tensor element_offsets(const at::Tensor& t) {
  at::Tensor offsets = at::full({1}, t.storage_offset(), at::kLong);
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    offsets =
        (offsets.unsqueeze(1) + at::arange(t.size(d), at::kLong).mul_(t.stride(d))).reshape(-1);
  }
  return offsets;
}

bool elements_overlap(const at::Tensor& t) {
  if (t.numel() <= 1) return false;
  switch (at::has_internal_overlap(t)) {
    case at::MemOverlap::No:
      return false;
    case at::MemOverlap::Yes:
      return true;
    case at::MemOverlap::TooHard:
      break;
  }
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest offset reachable with the dims seen so far
  bool separable = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= span) {
      separable = false;
      break;
    }
    span += stride * (size - 1);
  }
  if (separable) return false;
  if (t.numel() > kMaxListed) return true;
  const at::Tensor sorted = std::get<0>(element_offsets(t).sort());
  return sorted.slice(0, 1).eq(sorted.slice(0, 0, -1)).any().item<bool>();
}

std::string dtype_list(std::initializer_list<c10::ScalarType> allowed) {
  std::ostringstream os;
  bool first = true;
  for (auto d : allowed) {
    os << (first ? "" : ", ") << c10::toString(d);
    first = false;
  }
  return os.str();
}

}  // namespace

FlatTensorList FlatTensorList::prepare(at::TensorList tensors, const char* op, const char* arg,
                                       const c10::Device& device, bool writable,
                                       std::initializer_list<c10::ScalarType> allowed) {
  FlatTensorList out;
  out.list_size_ = static_cast<int64_t>(tensors.size());
  out.items_.reserve(tensors.size());
  // Pass 1: validate everything; nothing is allocated or written until all tensors pass.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": ", arg, "[", i,
                "] is undefined (None); drop parameters without grads from the list");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, "[", i, "] has layout ", t.layout(),
                "; expected a dense (strided) tensor. For sparse grads pass grad._values()");
    TORCH_CHECK(t.device() == device, op, ": ", arg, "[", i, "] is on ", t.device(),
                " but the op runs on ", device,
                " (the device of its scalar tensors); group tensors by device");
    bool ok = false;
    for (auto d : allowed) ok = ok || (t.scalar_type() == d);
    // NotImplementedError (a RuntimeError), as PyTorch's own dtype dispatch raises for a dtype
    // its kernel lacks ("... not implemented for 'ComplexFloat'").
    TORCH_CHECK_NOT_IMPLEMENTED(ok, op, ": ", arg, "[", i, "] has dtype ", t.scalar_type(),
                                " (not implemented for it); expected one of ", dtype_list(allowed));
    if (writable) {
      TORCH_CHECK(!elements_overlap(t), op, ": ", arg, "[", i,
                  "] is a view whose elements overlap in memory (e.g. from expand() or "
                  "as_strided()); it cannot be written in place. Pass a tensor with its own "
                  "storage (.clone())");
    }
  }
  // Pass 2: flatten.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    at::Tensor src = t;
    if (!t.is_non_overlapping_and_dense()) {
      src = t.contiguous();
      // Read-only lists keep the temporary alive only; writable ones also copy it back.
      out.staged_.emplace_back(writable ? t : at::Tensor(), src);
    }
    out.items_.push_back(
        FlatTensor{src.data_ptr(), src.numel(), src.scalar_type(), static_cast<int64_t>(i)});
  }
  return out;
}

void FlatTensorList::write_back() {
  for (auto& [dst, tmp] : staged_) {
    if (dst.defined()) dst.copy_(tmp);
  }
}

namespace {

struct Conflict {
  size_t a, b;  // positions in the flattened sequence of tensors (a listed before b in memory)
  at::MemOverlapStatus status;
};

// The first pair of tensors of `tensors` (pointers in caller order) that share memory, if any.
c10::optional<Conflict> first_conflict(const std::vector<const at::Tensor*>& tensors) {
  struct Span {
    uintptr_t begin, end;  // bytes [begin, end) that bound the tensor's elements
    size_t pos;
    const at::Tensor* t;
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = *tensors[i];
    if (!t.defined() || t.numel() == 0) continue;
    int64_t lo = 0, hi = 0;  // element offsets reachable from data_ptr (strides may be < 0)
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t reach = t.stride(d) * (t.size(d) - 1);
      (reach < 0 ? lo : hi) += reach;
    }
    const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
    const auto item = static_cast<uintptr_t>(t.element_size());
    spans.push_back(Span{base + static_cast<uintptr_t>(lo) * item,
                         base + static_cast<uintptr_t>(hi + 1) * item, i, &t});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size() && spans[j].begin < spans[i].end; ++j) {
      const Span& a = spans[i];
      const Span& b = spans[j];
      // Overlapping bounds: exact for dense tensors; strided views may still interleave.
      auto status = at::MemOverlapStatus::Partial;
      if (!(a.t->is_non_overlapping_and_dense() && b.t->is_non_overlapping_and_dense())) {
        status = at::get_overlap_status(*a.t, *b.t);
        // Strided views of one storage (e.g. x[::2] and x[1::2]): compare the elements.
        if (status == at::MemOverlapStatus::TooHard && a.t->is_alias_of(*b.t) &&
            a.t->element_size() == b.t->element_size() && a.t->numel() <= kMaxListed &&
            b.t->numel() <= kMaxListed) {
          const bool shared =
              at::isin(element_offsets(*b.t), element_offsets(*a.t)).any().item<bool>();
          status = shared ? at::MemOverlapStatus::Partial : at::MemOverlapStatus::No;
        }
      }
      if (status != at::MemOverlapStatus::No) return Conflict{a.pos, b.pos, status};
    }
  }
  return c10::nullopt;
}

}  // namespace

void check_disjoint(const char* op,
                    const std::vector<std::pair<const char*, at::TensorList>>& lists) {
  std::vector<const at::Tensor*> tensors;
  std::vector<std::pair<const char*, size_t>> names;  // (arg, index) of each tensor
  for (const auto& [arg, list] : lists) {
    for (size_t i = 0; i < list.size(); ++i) {
      tensors.push_back(&list[i]);
      names.emplace_back(arg, i);
    }
  }
  const auto c = first_conflict(tensors);
  if (!c.has_value()) return;
  const auto& a = names[c->a];
  const auto& b = names[c->b];
  TORCH_CHECK(false, op, ": ", b.first, "[", b.second, "] and ", a.first, "[", a.second, "] ",
              c->status == at::MemOverlapStatus::TooHard ? "may share memory" : "share memory",
              "; both are written, so shared elements would be updated twice. Pass each "
              "tensor once, with its own storage (deduplicate the list, or .clone())");
}

std::vector<int64_t> find_shared_memory(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && elements_overlap(tensors[i])) {
      return {static_cast<int64_t>(i), static_cast<int64_t>(i)};
    }
  }
  std::vector<const at::Tensor*> ptrs;
  ptrs.reserve(tensors.size());
  for (const auto& t : tensors) ptrs.push_back(&t);
  const auto c = first_conflict(ptrs);
  if (!c.has_value()) return {};
  return {static_cast<int64_t>(std::min(c->a, c->b)), static_cast<int64_t>(std::max(c->a, c->b))};
}

void check_scalar_tensor(const at::Tensor& t, const char* op, const char* arg,
                         const c10::Device& device, c10::ScalarType dtype, bool as_runtime_error) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is undefined; expected a one-element ",
              c10::toString(dtype), " tensor");
  TORCH_CHECK(t.device() == device, op, ": ", arg, " is on ", t.device(), "; expected ", device);
  if (as_runtime_error) {
    // PyTorch's amp ops raise RuntimeError for a scalar tensor of the wrong dtype or size.
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", arg, " has dtype ", t.scalar_type(),
                "; expected ", c10::toString(dtype));
    TORCH_CHECK(t.numel() == 1, op, ": ", arg, " has ", t.numel(),
                " elements; expected a one-element tensor");
  } else {
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", arg, " has dtype ", t.scalar_type(),
                     "; expected ", c10::toString(dtype));
    TORCH_CHECK_VALUE(t.numel() == 1, op, ": ", arg, " has ", t.numel(),
                      " elements; expected a one-element tensor");
  }
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " must be a dense tensor");
}

}  // namespace fastamp
