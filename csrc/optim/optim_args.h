/// @file optim_args.h
/// The arguments of the fused optimizer ops, each op's written out once: the op functions that the
/// dispatcher calls (adam_step_op, ...) pack their schema's arguments into one struct
/// (AdamArgs, ...) and hand it to the kernel they wrap, so the checks, the CPU and CUDA launchers
/// and the no-kernel fallback each take one parameter. The schemas are in ops.cpp.
#pragma once

#include "optim/optim_math.h"

#include "common/held_tensors.h"
#include "common/torch_api.h"

#include <cstdint>

namespace fastamp {
namespace optim {

/// The optional device scalars of every step op (lr_tensor overrides the float lr).
struct StepTensors {
  OptTensor lr_tensor;
  OptTensor inv_scale;
  OptTensor found_inf;
  OptTensor clip_coef;
};

/// The float and bool hyper-parameters of adam_step_ and adam_lowbit_step_ (amsgrad: false for
/// the latter, whose schema has none).
struct AdamOptions {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
  bool amsgrad;
  bool decoupled_weight_decay;
  bool maximize;

  AdamHyper hyper() const {
    return adam_hyper(beta1, beta2, weight_decay, eps, amsgrad, decoupled_weight_decay, maximize);
  }
};

/// The float and bool hyper-parameters of sgd_step_ and sgd_lowbit_step_.
struct SgdOptions {
  double lr;
  double weight_decay;
  double momentum;
  double dampening;
  bool nesterov;
  bool maximize;

  SgdHyper hyper() const {
    return sgd_hyper(weight_decay, momentum, dampening, nesterov, maximize);
  }
};

/// fastamp::adam_step_'s arguments.
struct AdamArgs {
  static constexpr const char* kOp = "fastamp::adam_step_";
  TensorList params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params;
  AdamOptions opt;
  StepTensors tensors;
  /// The handle of a `*_held_` op's lists (all but the grads), or null.
  const HeldLists* held = nullptr;
};

/// fastamp::adam_lowbit_step_'s arguments.
struct AdamLowbitArgs {
  static constexpr const char* kOp = "fastamp::adam_lowbit_step_";
  TensorList params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmax, exp_avg_sq_absmax, state_steps,
      master_params;
  int64_t seed;
  AdamOptions opt;
  StepTensors tensors;
};

/// fastamp::sgd_step_'s arguments.
struct SgdArgs {
  static constexpr const char* kOp = "fastamp::sgd_step_";
  TensorList params, grads, momentum_buffers, state_steps, master_params;
  SgdOptions opt;
  StepTensors tensors;
  /// The handle of a `*_held_` op's lists (all but the grads), or null.
  const HeldLists* held = nullptr;
};

/// fastamp::sgd_lowbit_step_'s arguments.
struct SgdLowbitArgs {
  static constexpr const char* kOp = "fastamp::sgd_lowbit_step_";
  TensorList params, grads, momentum_buffers, state_steps, master_params;
  int64_t seed;
  SgdOptions opt;
  StepTensors tensors;
};

// --- the op functions, one per schema (ops.cpp), each wrapping a kernel of one struct
// -------------- Registered as e.g. `m.impl("adam_step_",
// TORCH_BOX(&adam_step_op<adam_step_cpu>))`.

template <void (*Kernel)(const AdamArgs&)>
void adam_step_op(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                  TensorList max_exp_avg_sqs, TensorList state_steps, TensorList master_params,
                  double lr, const OptTensor& lr_tensor, double beta1, double beta2,
                  double weight_decay, double eps, bool amsgrad, bool decoupled_weight_decay,
                  bool maximize, const OptTensor& inv_scale, const OptTensor& found_inf,
                  const OptTensor& clip_coef) {
  Kernel(AdamArgs{params,
                  grads,
                  exp_avgs,
                  exp_avg_sqs,
                  max_exp_avg_sqs,
                  state_steps,
                  master_params,
                  {lr, beta1, beta2, weight_decay, eps, amsgrad, decoupled_weight_decay, maximize},
                  {lr_tensor, inv_scale, found_inf, clip_coef}});
}

template <void (*Kernel)(const AdamLowbitArgs&)>
void adam_lowbit_step_op(TensorList params, TensorList grads, TensorList exp_avgs,
                         TensorList exp_avg_sqs, TensorList exp_avg_absmax,
                         TensorList exp_avg_sq_absmax, TensorList state_steps,
                         TensorList master_params, int64_t seed, double lr,
                         const OptTensor& lr_tensor, double beta1, double beta2,
                         double weight_decay, double eps, bool decoupled_weight_decay,
                         bool maximize, const OptTensor& inv_scale, const OptTensor& found_inf,
                         const OptTensor& clip_coef) {
  Kernel(
      AdamLowbitArgs{params,
                     grads,
                     exp_avgs,
                     exp_avg_sqs,
                     exp_avg_absmax,
                     exp_avg_sq_absmax,
                     state_steps,
                     master_params,
                     seed,
                     {lr, beta1, beta2, weight_decay, eps, false, decoupled_weight_decay, maximize},
                     {lr_tensor, inv_scale, found_inf, clip_coef}});
}

template <void (*Kernel)(const SgdArgs&)>
void sgd_step_op(TensorList params, TensorList grads, TensorList momentum_buffers,
                 TensorList state_steps, TensorList master_params, double lr,
                 const OptTensor& lr_tensor, double weight_decay, double momentum, double dampening,
                 bool nesterov, bool maximize, const OptTensor& inv_scale,
                 const OptTensor& found_inf, const OptTensor& clip_coef) {
  Kernel(SgdArgs{params,
                 grads,
                 momentum_buffers,
                 state_steps,
                 master_params,
                 {lr, weight_decay, momentum, dampening, nesterov, maximize},
                 {lr_tensor, inv_scale, found_inf, clip_coef}});
}

template <void (*Kernel)(const SgdLowbitArgs&)>
void sgd_lowbit_step_op(TensorList params, TensorList grads, TensorList momentum_buffers,
                        TensorList state_steps, TensorList master_params, int64_t seed, double lr,
                        const OptTensor& lr_tensor, double weight_decay, double momentum,
                        double dampening, bool nesterov, bool maximize, const OptTensor& inv_scale,
                        const OptTensor& found_inf, const OptTensor& clip_coef) {
  Kernel(SgdLowbitArgs{params,
                       grads,
                       momentum_buffers,
                       state_steps,
                       master_params,
                       seed,
                       {lr, weight_decay, momentum, dampening, nesterov, maximize},
                       {lr_tensor, inv_scale, found_inf, clip_coef}});
}

// --- the held variants (`*_held_`): the list-taking op functions above, with every list but the
// grads taken from fastamp::hold_tensors (common/held_tensors.h), in that schema's order.
// Registered beside each list-taking op, e.g. `m.impl("adam_step_held_",
// TORCH_BOX(&adam_step_held_op<adam_step_cpu>))`.

template <void (*Kernel)(const AdamArgs&)>
void adam_step_held_op(int64_t held, TensorList grads, double lr, const OptTensor& lr_tensor,
                       double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                       bool decoupled_weight_decay, bool maximize, const OptTensor& inv_scale,
                       const OptTensor& found_inf, const OptTensor& clip_coef) {
  const auto h = held_lists(held, 6, "fastamp::adam_step_held_");
  const auto lock = h->guard();
  Kernel(AdamArgs{h->list(0),
                  grads,
                  h->list(1),
                  h->list(2),
                  h->list(3),
                  h->list(4),
                  h->list(5),
                  {lr, beta1, beta2, weight_decay, eps, amsgrad, decoupled_weight_decay, maximize},
                  {lr_tensor, inv_scale, found_inf, clip_coef},
                  h.get()});
}

template <void (*Kernel)(const AdamLowbitArgs&)>
void adam_lowbit_step_held_op(int64_t held, TensorList grads, int64_t seed, double lr,
                              const OptTensor& lr_tensor, double beta1, double beta2,
                              double weight_decay, double eps, bool decoupled_weight_decay,
                              bool maximize, const OptTensor& inv_scale, const OptTensor& found_inf,
                              const OptTensor& clip_coef) {
  const auto h = held_lists(held, 7, "fastamp::adam_lowbit_step_held_");
  adam_lowbit_step_op<Kernel>(h->list(0), grads, h->list(1), h->list(2), h->list(3), h->list(4),
                              h->list(5), h->list(6), seed, lr, lr_tensor, beta1, beta2,
                              weight_decay, eps, decoupled_weight_decay, maximize, inv_scale,
                              found_inf, clip_coef);
}

template <void (*Kernel)(const SgdArgs&)>
void sgd_step_held_op(int64_t held, TensorList grads, double lr, const OptTensor& lr_tensor,
                      double weight_decay, double momentum, double dampening, bool nesterov,
                      bool maximize, const OptTensor& inv_scale, const OptTensor& found_inf,
                      const OptTensor& clip_coef) {
  const auto h = held_lists(held, 4, "fastamp::sgd_step_held_");
  const auto lock = h->guard();
  Kernel(SgdArgs{h->list(0),
                 grads,
                 h->list(1),
                 h->list(2),
                 h->list(3),
                 {lr, weight_decay, momentum, dampening, nesterov, maximize},
                 {lr_tensor, inv_scale, found_inf, clip_coef},
                 h.get()});
}

template <void (*Kernel)(const SgdLowbitArgs&)>
void sgd_lowbit_step_held_op(int64_t held, TensorList grads, int64_t seed, double lr,
                             const OptTensor& lr_tensor, double weight_decay, double momentum,
                             double dampening, bool nesterov, bool maximize,
                             const OptTensor& inv_scale, const OptTensor& found_inf,
                             const OptTensor& clip_coef) {
  const auto h = held_lists(held, 4, "fastamp::sgd_lowbit_step_held_");
  sgd_lowbit_step_op<Kernel>(h->list(0), grads, h->list(1), h->list(2), h->list(3), seed, lr,
                             lr_tensor, weight_decay, momentum, dampening, nesterov, maximize,
                             inv_scale, found_inf, clip_coef);
}

}  // namespace optim
}  // namespace fastamp
