// CPU kernels of the fused optimizer ops: validate, skip on overflow, cut every param into chunks,
// run the per-ISA chunk kernels in parallel, then advance the step counters.
#include "common/torch_api.h"

#include "common/cpu_capability.h"
#include "common/multi_tensor_apply_cpu.h"
#include "optim/optim_checks.h"
#include "optim/optim_cpu_kernels.h"

namespace fastamp {
namespace optim {
namespace {

inline char* at_elem(const FlatTensor& t, int64_t start) {
  return static_cast<char*>(t.data) + start * static_cast<int64_t>(element_size(t.dtype));
}

inline void* at_elem_or_null(const FlatTensorList* list, size_t item, int64_t start) {
  return list == nullptr ? nullptr : at_elem(list->items()[item], start);
}

// Reads the per-step device scalars; on CPU they are host memory, so this is not a sync.
struct CpuScalars {
  bool skip;
  float inv_scale;
  float clip_coef;
};

CpuScalars read_scalars(const StepScalars& s) {
  return CpuScalars{s.found_inf != nullptr && *s.found_inf != 0.0f,
                    s.inv_scale != nullptr ? *s.inv_scale : 1.0f,
                    s.clip_coef != nullptr ? *s.clip_coef : 1.0f};
}

// The step counter of a state_steps tensor (checked to be a one-element float32 tensor: the raw
// pointer skips the dtype check a typed stable-ABI access repeats, through torch, per tensor).
inline float* step_of(const Tensor& t) {
  return static_cast<float*>(t.data_ptr());
}

void advance_steps(TensorList steps) {
  for (const auto& t : steps) *step_of(t) += 1.0f;
}

void adam_step_cpu(const AdamArgs& args) {
  const TensorList state_steps = args.state_steps;
  StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const CpuScalars s = read_scalars(dev);
  if (s.skip) return;  // an overflowed step writes nothing, not even the step counters
  const double lr_v = dev.lr != nullptr ? static_cast<double>(*dev.lr) : args.opt.lr;
  const AdamHyper h = args.opt.hyper();
  const auto& items = plan.params.items();
  std::vector<AdamCoefs> coefs(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const double step = static_cast<double>(*step_of(state_steps[items[i].index])) + 1.0;
    coefs[i] = adam_coefs(h, lr_v, step);
  }
  const FlatTensorList* vmax = args.opt.amsgrad ? &plan.state[2] : nullptr;
  const FlatTensorList* master = plan.has_master ? &plan.master : nullptr;
  const OptimCpuKernels& k = optim_cpu_kernels();
  cpu_for_each_chunk(plan_chunks(items), [&](int64_t, const Chunk& ch) {
    const size_t it = static_cast<size_t>(ch.item);
    AdamChunk a{items[it].dtype,
                at_elem(items[it], ch.start),
                at_elem(plan.grads.items()[it], ch.start),
                at_elem(plan.state[0].items()[it], ch.start),
                at_elem(plan.state[1].items()[it], ch.start),
                at_elem_or_null(vmax, it, ch.start),
                static_cast<float*>(at_elem_or_null(master, it, ch.start)),
                ch.len,
                s.inv_scale,
                s.clip_coef};
    k.adam(a, h, coefs[it]);
  });
  advance_steps(state_steps);
}

void sgd_step_cpu(const SgdArgs& args) {
  const TensorList state_steps = args.state_steps;
  StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const CpuScalars s = read_scalars(dev);
  if (s.skip) return;
  const float neg_lr =
      static_cast<float>(-(dev.lr != nullptr ? static_cast<double>(*dev.lr) : args.opt.lr));
  const SgdHyper h = args.opt.hyper();
  const auto& items = plan.params.items();
  const FlatTensorList* bufs = args.opt.momentum != 0.0 ? &plan.state[0] : nullptr;
  const FlatTensorList* master = plan.has_master ? &plan.master : nullptr;
  const OptimCpuKernels& k = optim_cpu_kernels();
  cpu_for_each_chunk(plan_chunks(items), [&](int64_t, const Chunk& ch) {
    const size_t it = static_cast<size_t>(ch.item);
    SgdChunk a{items[it].dtype,
               at_elem(items[it], ch.start),
               at_elem(plan.grads.items()[it], ch.start),
               at_elem_or_null(bufs, it, ch.start),
               static_cast<float*>(at_elem_or_null(master, it, ch.start)),
               ch.len,
               s.inv_scale,
               s.clip_coef,
               neg_lr,
               *step_of(state_steps[items[it].index]) == 0.0f};
    k.sgd(a, h);
  });
  advance_steps(state_steps);
}

void adam_lowbit_step_cpu(const AdamLowbitArgs& args) {
  const TensorList state_steps = args.state_steps;
  const int64_t seed = args.seed;
  LowbitPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const CpuScalars s = read_scalars(dev);
  if (s.skip) return;  // an overflowed step writes nothing, not even the step counters
  const double lr_v = dev.lr != nullptr ? static_cast<double>(*dev.lr) : args.opt.lr;
  const AdamHyper h = args.opt.hyper();
  const auto& items = plan.params.items();
  std::vector<AdamCoefs> coefs(items.size());
  std::vector<uint32_t> keys(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const float old = *step_of(state_steps[items[i].index]);
    coefs[i] = adam_coefs(h, lr_v, static_cast<double>(old) + 1.0);
    keys[i] = sr_key(static_cast<uint32_t>(seed), static_cast<uint32_t>(old + 1.0f),
                     static_cast<uint32_t>(items[i].index));
  }
  const FlatTensorList* master = plan.has_master ? &plan.master : nullptr;
  const OptimCpuKernels& k = optim_cpu_kernels();
  const auto kernel = plan.int8 ? k.adam_q8 : k.adam_bf16;
  cpu_for_each_chunk(plan_chunks(items), [&](int64_t, const Chunk& ch) {
    const size_t it = static_cast<size_t>(ch.item);
    float* am = nullptr;
    float* av = nullptr;
    if (plan.int8) {  // chunks start on a block boundary (kChunkElems % kQuantBlock == 0)
      am = static_cast<float*>(plan.absmax[0].items()[it].data) + ch.start / kQuantBlock;
      av = static_cast<float*>(plan.absmax[1].items()[it].data) + ch.start / kQuantBlock;
    }
    AdamLowbitChunk a{items[it].dtype,
                      at_elem(items[it], ch.start),
                      at_elem(plan.grads.items()[it], ch.start),
                      at_elem(plan.state[0].items()[it], ch.start),
                      at_elem(plan.state[1].items()[it], ch.start),
                      am,
                      av,
                      static_cast<float*>(at_elem_or_null(master, it, ch.start)),
                      ch.len,
                      ch.start,
                      keys[it],
                      s.inv_scale,
                      s.clip_coef};
    kernel(a, h, coefs[it]);
  });
  advance_steps(state_steps);
}

void sgd_lowbit_step_cpu(const SgdLowbitArgs& args) {
  const TensorList state_steps = args.state_steps;
  const int64_t seed = args.seed;
  StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const CpuScalars s = read_scalars(dev);
  if (s.skip) return;  // an overflowed step writes nothing, not even the update counts
  const float neg_lr =
      static_cast<float>(-(dev.lr != nullptr ? static_cast<double>(*dev.lr) : args.opt.lr));
  const SgdHyper h = args.opt.hyper();
  const auto& items = plan.params.items();
  std::vector<float> olds(items.size());
  std::vector<uint32_t> keys(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    olds[i] = *step_of(state_steps[items[i].index]);
    keys[i] = sr_key(static_cast<uint32_t>(seed), static_cast<uint32_t>(olds[i] + 1.0f),
                     static_cast<uint32_t>(items[i].index));
  }
  const FlatTensorList* master = plan.has_master ? &plan.master : nullptr;
  const OptimCpuKernels& k = optim_cpu_kernels();
  cpu_for_each_chunk(plan_chunks(items), [&](int64_t, const Chunk& ch) {
    const size_t it = static_cast<size_t>(ch.item);
    SgdChunk a{items[it].dtype,
               at_elem(items[it], ch.start),
               at_elem(plan.grads.items()[it], ch.start),
               at_elem(plan.state[0].items()[it], ch.start),
               static_cast<float*>(at_elem_or_null(master, it, ch.start)),
               ch.len,
               s.inv_scale,
               s.clip_coef,
               neg_lr,
               olds[it] == 0.0f,
               ch.start,
               keys[it]};
    k.sgd_bf16(a, h);
  });
  advance_steps(state_steps);
}

static_assert(kChunkElems % kQuantBlock == 0, "a quantization block must not straddle two chunks");

}  // namespace

const OptimCpuKernels& optim_cpu_kernels() {
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_use_avx512()) return optim_cpu_kernels_avx512();
  if (cpu_use_avx2()) return optim_cpu_kernels_avx2();
#endif
  return optim_cpu_kernels_default();
}

}  // namespace optim
}  // namespace fastamp

STABLE_TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  namespace o = fastamp::optim;
  m.impl("adam_step_", TORCH_BOX(&o::adam_step_op<o::adam_step_cpu>));
  m.impl("sgd_step_", TORCH_BOX(&o::sgd_step_op<o::sgd_step_cpu>));
  m.impl("adam_lowbit_step_", TORCH_BOX(&o::adam_lowbit_step_op<o::adam_lowbit_step_cpu>));
  m.impl("sgd_lowbit_step_", TORCH_BOX(&o::sgd_lowbit_step_op<o::sgd_lowbit_step_cpu>));
  m.impl("adam_step_held_", TORCH_BOX(&o::adam_step_held_op<o::adam_step_cpu>));
  m.impl("sgd_step_held_", TORCH_BOX(&o::sgd_step_held_op<o::sgd_step_cpu>));
  m.impl("adam_lowbit_step_held_",
         TORCH_BOX(&o::adam_lowbit_step_held_op<o::adam_lowbit_step_cpu>));
  m.impl("sgd_lowbit_step_held_", TORCH_BOX(&o::sgd_lowbit_step_held_op<o::sgd_lowbit_step_cpu>));
}
