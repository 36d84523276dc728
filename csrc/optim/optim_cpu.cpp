// CPU kernels of the fused optimizer ops: one driver (validate, skip on overflow, cut every param
// into chunks, run them in parallel, advance the step counters) and one functor per optimizer
// that turns a chunk into the per-ISA chunk kernel's arguments (optim_cpu_kernels.h).
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

// The per-step scalars, read once per call; on CPU they are host memory, so this is not a sync.
struct CpuScalars {
  bool skip;
  float inv_scale;
  float clip_coef;
  double lr;  ///< lr_tensor's value when given, else the option
};

CpuScalars read_scalars(const StepScalars& s, double lr) {
  return CpuScalars{s.found_inf != nullptr && *s.found_inf != 0.0f,
                    s.inv_scale != nullptr ? *s.inv_scale : 1.0f,
                    s.clip_coef != nullptr ? *s.clip_coef : 1.0f,
                    s.lr != nullptr ? static_cast<double>(*s.lr) : lr};
}

// The step counter of a state_steps tensor (checked to be a one-element float32 tensor: the raw
// pointer skips the dtype check a typed stable-ABI access repeats, through torch, per tensor).
inline float* step_of(const Tensor& t) {
  return static_cast<float*>(t.data_ptr());
}

// The one driver of the four CPU step ops (apex's multi-tensor pattern: a driver and one functor
// per optimizer). An overflowed step (found_inf != 0) writes nothing, not even the step counters;
// otherwise the functor sees each param's old step counter (`begin`, in list order, before any
// chunk runs), then every chunk of every param in parallel (`chunk`), and the counters advance.
//   Op::begin(size_t item, float old_step, int64_t index, const CpuScalars& s)
//       per param, in order; `index`: the param's position in the op's lists
//   Op::chunk(const Chunk& ch, const CpuScalars& s)     per chunk, on any thread
template <typename Op>
void run_step(const StepPlan& plan, TensorList state_steps, double lr, Op&& op) {
  if (plan.empty()) return;
  const CpuScalars s = read_scalars(plan.scalars, lr);
  if (s.skip) return;
  const auto& items = plan.params.items();
  for (size_t i = 0; i < items.size(); ++i) {
    op.begin(i, *step_of(state_steps[items[i].index]), items[i].index, s);
  }
  cpu_for_each_chunk(plan_chunks(items), [&](int64_t, const Chunk& ch) { op.chunk(ch, s); });
  for (const auto& t : state_steps) *step_of(t) += 1.0f;
}

// What every functor reads of its plan (AdamPlan, SgdPlan, LowbitPlan): the chunk's element in
// a list, by param and offset.
template <typename Plan>
struct ChunkLists {
  const Plan& plan;

  void* param(const Chunk& ch) const { return at(plan.params, ch); }
  const void* grad(const Chunk& ch) const { return at(plan.grads, ch); }
  float* master(const Chunk& ch) const {
    return plan.has_master ? static_cast<float*>(at(plan.master, ch)) : nullptr;
  }
  static void* at(const FlatTensorList& list, const Chunk& ch) {
    return at_elem(list.items()[static_cast<size_t>(ch.item)], ch.start);
  }
  static void* at(const FlatTensorList* list, const Chunk& ch) {
    return list == nullptr ? nullptr : at(*list, ch);
  }
};

// The bias corrections of one step count (two double pows), made once per run of params with the
// same count: params stepped together share it, so a call over 121 params makes 2 pows, not 242.
// The same inputs to the same arithmetic: the same bits as one adam_coefs per param.
class AdamCoefsOfStep {
 public:
  const AdamCoefs& of(const AdamHyper& h, double lr, float old_step) {
    if (!made_ || !(old_step == step_)) {  // (a NaN count is never equal: made anew)
      coefs_ = adam_coefs(h, lr, static_cast<double>(old_step) + 1.0);
      step_ = old_step;
      made_ = true;
    }
    return coefs_;
  }

 private:
  bool made_ = false;
  float step_ = 0.0f;
  AdamCoefs coefs_{};
};

// AdamW/Adam: the step's bias corrections per param (double pow), then the chunk kernel.
struct AdamCpu : ChunkLists<AdamPlan> {
  AdamHyper h;
  std::vector<AdamCoefs> coefs;
  AdamCoefsOfStep of_step;

  AdamCpu(const AdamPlan& p, const AdamHyper& hyper)
      : ChunkLists{p}, h(hyper), coefs(p.params.list_size()) {}
  void begin(size_t i, float old_step, int64_t, const CpuScalars& s) {
    coefs[i] = of_step.of(h, s.lr, old_step);
  }
  void chunk(const Chunk& ch, const CpuScalars& s) const {
    const size_t it = static_cast<size_t>(ch.item);
    const AdamChunk a{plan.params.items()[it].dtype,
                      param(ch),
                      grad(ch),
                      at(plan.exp_avgs(), ch),
                      at(plan.exp_avg_sqs(), ch),
                      at(plan.max_exp_avg_sqs(), ch),
                      master(ch),
                      ch.len,
                      s.inv_scale,
                      s.clip_coef};
    optim_cpu_kernels().adam(a, h, coefs[it]);
  }
};

// SGD (float state or bfloat16 momentum with stochastic rounding, `lowbit`): a param's first
// step (old counter 0) sets its momentum buffer instead of decaying it.
struct SgdCpu : ChunkLists<SgdPlan> {
  SgdHyper h;
  bool lowbit;
  uint32_t seed;
  std::vector<uint8_t> first;
  std::vector<uint32_t> keys;  ///< lowbit: the stochastic rounding's key per param

  SgdCpu(const SgdPlan& p, const SgdHyper& hyper, bool lowbit_state, int64_t seed_)
      : ChunkLists{p},
        h(hyper),
        lowbit(lowbit_state),
        seed(static_cast<uint32_t>(seed_)),
        first(p.params.list_size()),
        keys(p.params.list_size()) {}
  void begin(size_t i, float old_step, int64_t index, const CpuScalars&) {
    first[i] = old_step == 0.0f;
    if (lowbit) {
      keys[i] = sr_key(seed, static_cast<uint32_t>(old_step + 1.0f), static_cast<uint32_t>(index));
    }
  }
  void chunk(const Chunk& ch, const CpuScalars& s) const {
    const size_t it = static_cast<size_t>(ch.item);
    const SgdChunk a{plan.params.items()[it].dtype,
                     param(ch),
                     grad(ch),
                     at(plan.momentum_buffers(), ch),
                     master(ch),
                     ch.len,
                     s.inv_scale,
                     s.clip_coef,
                     static_cast<float>(-s.lr),
                     first[it] != 0,
                     ch.start,
                     keys[it]};
    const OptimCpuKernels& k = optim_cpu_kernels();
    (lowbit ? k.sgd_bf16 : k.sgd)(a, h);
  }
};

// Adam with bfloat16 state (stochastic rounding) or 8-bit codes with per-block scales.
struct AdamLowbitCpu : ChunkLists<LowbitPlan> {
  AdamHyper h;
  uint32_t seed;
  std::vector<AdamCoefs> coefs;
  std::vector<uint32_t> keys;
  AdamCoefsOfStep of_step;

  AdamLowbitCpu(const LowbitPlan& p, const AdamHyper& hyper, int64_t seed_)
      : ChunkLists{p},
        h(hyper),
        seed(static_cast<uint32_t>(seed_)),
        coefs(p.params.list_size()),
        keys(p.params.list_size()) {}
  void begin(size_t i, float old_step, int64_t index, const CpuScalars& s) {
    coefs[i] = of_step.of(h, s.lr, old_step);
    keys[i] = sr_key(seed, static_cast<uint32_t>(old_step + 1.0f), static_cast<uint32_t>(index));
  }
  void chunk(const Chunk& ch, const CpuScalars& s) const {
    const size_t it = static_cast<size_t>(ch.item);
    float* am = nullptr;
    float* av = nullptr;
    if (plan.int8) {  // chunks start on a block boundary (kChunkElems % kQuantBlock == 0)
      am = static_cast<float*>(plan.exp_avg_absmax().items()[it].data) + ch.start / kQuantBlock;
      av = static_cast<float*>(plan.exp_avg_sq_absmax().items()[it].data) + ch.start / kQuantBlock;
    }
    const AdamLowbitChunk a{plan.params.items()[it].dtype,
                            param(ch),
                            grad(ch),
                            at(plan.exp_avgs(), ch),
                            at(plan.exp_avg_sqs(), ch),
                            am,
                            av,
                            master(ch),
                            ch.len,
                            ch.start,
                            keys[it],
                            s.inv_scale,
                            s.clip_coef};
    const OptimCpuKernels& k = optim_cpu_kernels();
    (plan.int8 ? k.adam_q8 : k.adam_bf16)(a, h, coefs[it]);
  }
};

void adam_step_cpu(const AdamArgs& args) {
  const AdamPlan plan = check_args(args);
  run_step(plan, args.state_steps, args.opt.lr, AdamCpu(plan, args.opt.hyper()));
}

void sgd_step_cpu(const SgdArgs& args) {
  const SgdPlan plan = check_args(args);
  run_step(plan, args.state_steps, args.opt.lr, SgdCpu(plan, args.opt.hyper(), false, 0));
}

void adam_lowbit_step_cpu(const AdamLowbitArgs& args) {
  const LowbitPlan plan = check_args(args);
  run_step(plan, args.state_steps, args.opt.lr, AdamLowbitCpu(plan, args.opt.hyper(), args.seed));
}

void sgd_lowbit_step_cpu(const SgdLowbitArgs& args) {
  const SgdPlan plan = check_args(args);
  run_step(plan, args.state_steps, args.opt.lr, SgdCpu(plan, args.opt.hyper(), true, args.seed));
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
