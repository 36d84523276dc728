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

/// The validated arguments of fastamp::adam_step_, its state lists by name.
struct AdamPlan : StepPlan {
  const FlatTensorList& exp_avgs() const { return state[0]; }
  const FlatTensorList& exp_avg_sqs() const { return state[1]; }
  /// null unless amsgrad
  const FlatTensorList* max_exp_avg_sqs() const { return state.size() > 2 ? &state[2] : nullptr; }
};

/// The validated arguments of fastamp::sgd_step_ and fastamp::sgd_lowbit_step_.
struct SgdPlan : StepPlan {
  /// null when momentum == 0
  const FlatTensorList* momentum_buffers() const { return state.empty() ? nullptr : &state[0]; }
};

/// Everything fastamp::adam_step_ checks, for both backends, before anything is written.
AdamPlan check_args(const AdamArgs& a);

/// Everything fastamp::sgd_step_ checks, for both backends, before anything is written.
SgdPlan check_args(const SgdArgs& a);

/// The validated arguments of fastamp::adam_lowbit_step_: exp_avgs and exp_avg_sqs in bfloat16
/// or uint8 codes; with uint8 codes (`int8`), their block scales, float32 with one element per
/// 256-element block of each param.
struct LowbitPlan : AdamPlan {
  bool int8 = false;
  std::vector<FlatTensorList> absmax;
  const FlatTensorList& exp_avg_absmax() const { return absmax[0]; }
  const FlatTensorList& exp_avg_sq_absmax() const { return absmax[1]; }
};

/// Everything fastamp::adam_lowbit_step_ checks, for both backends, before anything is written.
LowbitPlan check_args(const AdamLowbitArgs& a);

/// Everything fastamp::sgd_lowbit_step_ checks (bfloat16 momentum buffers), for both backends.
SgdPlan check_args(const SgdLowbitArgs& a);

}  // namespace optim
}  // namespace fastamp
