/// @file digest_checks.h
/// Argument check of fastamp::tensor_digest, shared by its CPU and CUDA kernels.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace fastamp {
namespace checkpoint {

/// Validates `tensors` (strided, all on `device`) and returns them contiguous, so that the digest
/// is of the logical element order whatever the strides.
inline std::vector<at::Tensor> check_digest(at::TensorList tensors, const c10::Device& device) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "fastamp::tensor_digest: tensors[", i, "] is undefined (None)");
    TORCH_CHECK(t.layout() == at::kStrided, "fastamp::tensor_digest: tensors[", i, "] has layout ",
                t.layout(), "; expected a dense tensor");
    TORCH_CHECK(t.device() == device, "fastamp::tensor_digest: tensors[", i, "] is on ", t.device(),
                " but tensors[0] is on ", device, "; digest one device at a time");
  }
  for (const auto& t : tensors) out.push_back(t.contiguous());
  return out;
}

}  // namespace checkpoint
}  // namespace fastamp
