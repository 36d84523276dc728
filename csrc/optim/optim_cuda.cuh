/// @file optim_cuda.cuh
/// What the optimizer ops' CUDA launchers share (optim_cuda.cu, lowbit_cuda.cu): the step counters'
/// snapshot and advance (see optim_cuda.cu's header for the three passes of a step) and the
/// launch of an update over a plan's lists on the multi-tensor engine.
#pragma once

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "optim/optim_checks.h"

#include "common/torch_api.h"

#include <array>
#include <type_traits>
#include <vector>

namespace fastamp {
namespace optim {
namespace {

__device__ __forceinline__ bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// --- step counters
// -------------------------------------------------------------------------------- Both ops run
// over state_steps as a one-list MTA (one-element float32 tensors, so one block each; only thread 0
// works). Other dtypes cannot reach them (check_step), so only float is compiled.

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

/// Runs `op`, an Op::kDepth-list update, over the lists of `plan` in the ops' layout: params,
/// grads, state..., [master], then `side`: the engine's side lists (one element per
/// kMtaSideBlock elements of the params, e.g. the 8-bit state's block scales), Side of them.
template <int Side = 0, typename Op>
void run_update(const StepPlan& plan, const Op& op, const std::vector<FlatTensorList>& side = {}) {
  constexpr int kDepth = Op::kDepth;
  std::vector<const std::vector<FlatTensor>*> l = {&plan.params.items(), &plan.grads.items()};
  for (const FlatTensorList& s : plan.state) l.push_back(&s.items());
  if (plan.has_master) l.push_back(&plan.master.items());
  for (const FlatTensorList& s : side) l.push_back(&s.items());
  FASTAMP_ASSERT(
      l.size() == static_cast<size_t>(kDepth) && side.size() == static_cast<size_t>(Side),
      "optim: ", l.size(), " lists (", side.size(), " side) for a ", kDepth, "-list kernel (", Side,
      " side)");
  std::array<const std::vector<FlatTensor>*, kDepth> lists;
  for (int d = 0; d < kDepth; ++d) lists[static_cast<size_t>(d)] = l[static_cast<size_t>(d)];
  cuda_multi_tensor_apply<kDepth, Op, Side>(lists, plan.device, op);
}

/// Everything of a step but the update pass: validates state_steps as a writable list (before
/// anything is written), snapshots the counters, runs `update(old_steps)` and advances the
/// counters. The op's checks admit dense tensors only, so no list of the plan is staged and
/// nothing needs copying back.
template <typename Update>
void run_step(const char* op, const StepPlan& plan, TensorList state_steps,
              const StepScalars& scalars, const Update& update) {
  gpu::check_device(plan.device, op, "params");
  FlatTensorList steps =
      FlatTensorList::prepare(state_steps, op, "state_steps", plan.device, true, {kFloat});
  gpu::DeviceGuard guard(plan.device);
  Tensor old_steps = empty({steps.list_size()}, kFloat, plan.device);
  float* old = old_steps.mutable_data_ptr<float>();
  // Every slot is written: state_steps entries have one element each, so none is dropped.
  cuda_multi_tensor_apply(steps.items(), plan.device, SnapshotStepsOp{old});
  update(static_cast<const float*>(old));
  cuda_multi_tensor_apply(steps.items(), plan.device, AdvanceStepsOp{scalars.found_inf});
}

}  // namespace
}  // namespace optim
}  // namespace fastamp
