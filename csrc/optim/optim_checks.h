/// @file optim_checks.h
/// Argument validation of the fused optimizer ops, shared by the CPU and CUDA kernels; every
/// check runs before anything is written.
#pragma once

#include "common/tensor_list.h"
#include "optim/optim_args.h"

#include "common/torch_api.h"

#include <vector>

namespace fastamp {
namespace optim {

/// Scalars that change every step, as optional device tensors (all on the params' device).
struct StepScalars {
  const float* lr = nullptr;  ///< overrides the float lr when given
  const float* inv_scale = nullptr;
  const float* found_inf = nullptr;
  const float* clip_coef = nullptr;
};

/// The validated arguments of one optimizer call. `state` holds the per-element state lists in
/// schema order (exp_avg, exp_avg_sq[, max_exp_avg_sq] or momentum_buffer); `master` is empty
/// unless master weights are used. Nothing else is set when there are no params (`empty()`).
struct StepPlan {
  FlatTensorList params;
  FlatTensorList grads;
  std::vector<FlatTensorList> state;
  FlatTensorList master;
  bool has_master = false;
  Device device = Device(DeviceType::CPU);
  StepScalars scalars;

  bool empty() const { return params.list_size() == 0; }
};

/// Everything fastamp::adam_step_ checks, for both backends, before anything is written.
StepPlan check_args(const AdamArgs& a);

/// Everything fastamp::sgd_step_ checks, for both backends, before anything is written.
StepPlan check_args(const SgdArgs& a);

/// The validated arguments of fastamp::adam_lowbit_step_: `state` = [exp_avgs, exp_avg_sqs] in
/// bfloat16 or uint8 codes; with uint8 codes (`int8`), `absmax` = [exp_avg_absmax,
/// exp_avg_sq_absmax], float32 with one element per 256-element block of each param.
struct LowbitPlan : StepPlan {
  bool int8 = false;
  std::vector<FlatTensorList> absmax;
};

/// Everything fastamp::adam_lowbit_step_ checks, for both backends, before anything is written.
LowbitPlan check_args(const AdamLowbitArgs& a);

/// Everything fastamp::sgd_lowbit_step_ checks (bfloat16 momentum buffers), for both backends.
StepPlan check_args(const SgdLowbitArgs& a);

}  // namespace optim
}  // namespace fastamp
