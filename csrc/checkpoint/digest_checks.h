/// @file digest_checks.h
/// Argument check of fastamp::tensor_digest, shared by its CPU and CUDA kernels.
#pragma once

#include "common/torch_api.h"

#include <vector>

namespace fastamp {
namespace checkpoint {

/// Validates `tensors` (strided, all on `device`) and returns them contiguous, so that the digest
/// is of the logical element order whatever the strides.
inline std::vector<Tensor> check_digest(TensorList tensors, const Device& device) {
  std::vector<Tensor> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    FASTAMP_CHECK(t.defined(), "fastamp::tensor_digest: tensors[", i, "] is undefined (None)");
    FASTAMP_CHECK(t.layout() == kStrided, "fastamp::tensor_digest: tensors[", i, "] has layout ",
                  t.layout(), "; expected a dense tensor");
    FASTAMP_CHECK(t.device() == device, "fastamp::tensor_digest: tensors[", i, "] is on ",
                  t.device(), " but tensors[0] is on ", device, "; digest one device at a time");
  }
  for (const auto& t : tensors) out.push_back(contiguous_copy(t));
  return out;
}

}  // namespace checkpoint
}  // namespace fastamp
