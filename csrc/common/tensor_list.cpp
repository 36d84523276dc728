#include "common/tensor_list.h"

#include <ATen/MemoryOverlap.h>

#include <sstream>
#include <string>

namespace fastamp {
namespace {

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
    if (writable && t.numel() > 0) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": ", arg, "[", i,
                  "] is a view whose elements overlap in memory (e.g. from expand()); it cannot be "
                  "written in place. Pass a tensor with its own storage (.clone())");
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
