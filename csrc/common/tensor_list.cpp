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
bool elements_overlap(const at::Tensor& t) {
  if (t.numel() <= 1) return false;
  switch (at::has_internal_overlap(t)) {
    case at::MemOverlap::No: return false;
    case at::MemOverlap::Yes: return true;
    case at::MemOverlap::TooHard: break;
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
  // Listing the offsets costs 8 bytes per element; beyond this size the layout is refused.
  constexpr int64_t kMaxListed = int64_t{1} << 24;
  if (t.numel() > kMaxListed) return true;
  at::Tensor offsets = at::zeros({1}, at::kLong);
  for (const auto& [stride, size] : dims) {
    offsets = (offsets.unsqueeze(1) + at::arange(size, at::kLong).mul_(stride)).reshape(-1);
  }
  const at::Tensor sorted = std::get<0>(offsets.sort());
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
    TORCH_CHECK_TYPE(ok, op, ": ", arg, "[", i, "] has dtype ", t.scalar_type(), "; expected one of ",
                     dtype_list(allowed));
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
    out.items_.push_back(FlatTensor{src.data_ptr(), src.numel(), src.scalar_type(),
                                    static_cast<int64_t>(i)});
  }
  return out;
}

void FlatTensorList::write_back() {
  for (auto& [dst, tmp] : staged_) {
    if (dst.defined()) dst.copy_(tmp);
  }
}

void check_scalar_tensor(const at::Tensor& t, const char* op, const char* arg,
                         const c10::Device& device, c10::ScalarType dtype) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is undefined; expected a one-element ",
              c10::toString(dtype), " tensor");
  TORCH_CHECK(t.device() == device, op, ": ", arg, " is on ", t.device(), "; expected ", device);
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", arg, " has dtype ", t.scalar_type(),
                   "; expected ", c10::toString(dtype));
  TORCH_CHECK_VALUE(t.numel() == 1, op, ": ", arg, " has ", t.numel(),
                    " elements; expected a one-element tensor");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " must be a dense tensor");
}

}  // namespace fastamp
