/// @file optim_cuda.cuh
/// What the optimizer ops' CUDA launchers share (optim_cuda.cu, lowbit_cuda.cu): the step counters'
/// snapshot and advance (see optim_cuda.cu's header for the three passes of a step) and the
/// launch of an update over a plan's lists on the multi-tensor engine.
#pragma once

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "optim/optim_checks.h"

#include <ATen/ATen.h>

#include <array>
#include <type_traits>
#include <vector>

namespace fastamp {
namespace optim {
namespace {

__device__ __forceinline__ bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// --- step counters --------------------------------------------------------------------------------
// Both ops run over state_steps as a one-list MTA (one-element float32 tensors, so one block each;
// only thread 0 works). Other dtypes cannot reach them (check_step), so only float is compiled.

struct SnapshotStepsOp {
  float* out;  // out[i] = state_steps[i]

  template <typename T>
  __device__ void apply(const MtaBlock<1>& blk) const {
    if constexpr (std::is_same_v<T, float>) {
      if (threadIdx.x == 0) out[blk.index] = *blk.ptr<float>(0);
    }
  }
};

struct AdvanceStepsOp {
  const float* found_inf;  // may be null

  template <typename T>
  __device__ void apply(const MtaBlock<1>& blk) const {
    if constexpr (std::is_same_v<T, float>) {
      // atomicAdd rather than +=: should one counter tensor appear twice in the list, it is
      // advanced twice, as on the CPU, instead of racing.
      if (threadIdx.x == 0 && !step_skipped(found_inf)) atomicAdd(blk.ptr<float>(0), 1.0f);
    }
  }
};

// --- host side ----------------------------------------------------------------------------------

/// The lists of `plan` in the ops' layout: params, grads, state..., [master].
std::vector<const std::vector<FlatTensor>*> update_lists(const StepPlan& plan) {
  std::vector<const std::vector<FlatTensor>*> l = {&plan.params.items(), &plan.grads.items()};
  for (const FlatTensorList& s : plan.state) l.push_back(&s.items());
  if (plan.has_master) l.push_back(&plan.master.items());
  return l;
}

template <int Depth, typename Op>
void run_update(const StepPlan& plan, const Op& op) {
  const auto l = update_lists(plan);
  TORCH_INTERNAL_ASSERT(l.size() == static_cast<size_t>(Depth), "optim: ", l.size(),
                        " lists for a ", Depth, "-list kernel");
  std::array<const std::vector<FlatTensor>*, Depth> lists;
  for (int d = 0; d < Depth; ++d) lists[static_cast<size_t>(d)] = l[static_cast<size_t>(d)];
  cuda_multi_tensor_apply<Depth, Op>(lists, plan.device, op);
}

/// Everything of a step but the update pass: validates state_steps as a writable list (before
/// anything is written), snapshots the counters, runs `update(old_steps)`, advances the counters,
/// and copies staged tensors back (none today: check_step admits dense tensors only).
template <typename Update>
void run_step(const char* op, StepPlan& plan, at::TensorList state_steps,
              const StepScalars& scalars, const Update& update) {
  gpu::check_device(plan.device, op, "params");
  FlatTensorList steps =
      FlatTensorList::prepare(state_steps, op, "state_steps", plan.device, true, {at::kFloat});
  gpu::DeviceGuard guard(plan.device);
  at::Tensor old_steps =
      at::empty({steps.list_size()}, at::TensorOptions().dtype(at::kFloat).device(plan.device));
  float* old = old_steps.data_ptr<float>();
  // Every slot is written: state_steps entries have one element each, so none is dropped.
  cuda_multi_tensor_apply(steps.items(), plan.device, SnapshotStepsOp{old});
  update(static_cast<const float*>(old));
  cuda_multi_tensor_apply(steps.items(), plan.device, AdvanceStepsOp{scalars.found_inf});
  plan.params.write_back();
  for (FlatTensorList& s : plan.state) s.write_back();
  if (plan.has_master) plan.master.write_back();
}

}  // namespace
}  // namespace optim
}  // namespace fastamp
