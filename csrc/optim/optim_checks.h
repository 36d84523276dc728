/// @file optim_checks.h
/// Argument validation of the fused optimizer ops, shared by the CPU and CUDA kernels; every
/// check runs before anything is written.
#pragma once

#include "common/tensor_list.h"

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

namespace fastamp {
namespace optim {

/// The validated lists of one optimizer call. `master` is empty unless master weights are used;
/// `extra` holds the per-element state lists (exp_avg, exp_avg_sq[, max_exp_avg_sq] or momentum).
struct StepPlan {
  FlatTensorList params;
  FlatTensorList grads;
  std::vector<FlatTensorList> state;
  FlatTensorList master;
  bool has_master = false;
  c10::Device device = c10::Device(c10::kCPU);
};

/// Scalars that change every step, as optional device tensors (all on the params' device).
struct StepScalars {
  const float* lr = nullptr;         ///< overrides the float lr when given
  const float* inv_scale = nullptr;
  const float* found_inf = nullptr;
  const float* clip_coef = nullptr;
};

StepPlan check_step(const char* op, at::TensorList params, at::TensorList grads,
                    const std::vector<std::pair<const char*, at::TensorList>>& state,
                    at::TensorList state_steps, at::TensorList master_params);

StepScalars check_scalars(const char* op, const c10::Device& device,
                          const c10::optional<at::Tensor>& lr_tensor,
                          const c10::optional<at::Tensor>& inv_scale,
                          const c10::optional<at::Tensor>& found_inf,
                          const c10::optional<at::Tensor>& clip_coef);

}  // namespace optim
}  // namespace fastamp
