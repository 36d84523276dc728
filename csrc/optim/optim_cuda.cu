// CUDA kernels of the fused optimizer ops. The element math comes from optim_math.h (shared with
// the CPU kernels); this file arranges it into per-chunk functors run by
// multi_tensor_apply_cuda.cuh, with every list of a param (param, grad, state, master) travelling
// as one MTA list, so one block updates one chunk of all of them.
//
// No host sync: lr_tensor, inv_scale, found_inf and clip_coef are read in the kernels through
// pointers, and so are the step counters. A step is three stream-ordered passes:
//   1. snapshot: copy every state_steps entry into a flat buffer (one slot per param);
//   2. update: each block reads its param's *old* step from the buffer (indexed by the param's
//      position in the caller's list), derives the step's coefficients and updates its chunk;
//   3. advance: add 1 to every state_steps entry.
// Passes 2 and 3 do nothing at all when *found_inf != 0. Splitting 1 from 3 means that no block of
// pass 2 can see a counter that has already moved, whatever the block order.
#include "common/torch_api.h"

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "optim/optim_checks.h"
#include "optim/optim_cuda.cuh"
#include "optim/optim_math.h"

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace fastamp {
namespace optim {
namespace {

// --- per-thread element access ------------------------------------------------------------------

/// Elements a thread takes per loop step from every list: 16-byte accesses for float32 lists,
/// 8-byte ones for half/bfloat16. The same element count in every list keeps one index for all.
constexpr int kPack = 4;

template <typename T>
using Pack = gpu::Vec<T, kPack>;

template <typename T>
__device__ __forceinline__ bool pack_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kPack) == 0;
}

/// x[j] = p[e + j] as float for j < valid (one vector load when `vec`, i.e. aligned and full).
/// Lanes past `valid` get 0 and are never stored.
template <typename T>
__device__ __forceinline__ void load_pack(const T* p, int e, int valid, bool vec,
                                          float (&x)[kPack]) {
  if (vec) {
    const Pack<T> r = gpu::vec_load(reinterpret_cast<const Pack<T>*>(p + e));
#pragma unroll
    for (int j = 0; j < kPack; ++j) x[j] = static_cast<float>(r.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kPack; ++j) x[j] = j < valid ? static_cast<float>(p[e + j]) : 0.0f;
  }
}

/// p[e + j] = T(x[j]) for j < valid, rounding to nearest even as the CPU kernels' store<T>.
template <typename T>
__device__ __forceinline__ void store_pack(T* p, int e, int valid, bool vec,
                                           const float (&x)[kPack]) {
  Pack<T> r;
#pragma unroll
  for (int j = 0; j < kPack; ++j) r.v[j] = static_cast<T>(x[j]);
  if (vec) {
    gpu::vec_store(reinterpret_cast<Pack<T>*>(p + e), r);
  } else {
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      if (j < valid) p[e + j] = r.v[j];
    }
  }
}

// --- update ops
// ------------------------------------------------------------------------------------- List layout
// (Depth = number of lists): 0 params (T), 1 grads (T), then the state lists (S), then
// master_params (float32) when kMaster. S = float with master weights, else T. The flags are
// template parameters so the element loop has no per-element branch on them.

template <bool kAmsgrad, bool kMaster>
struct AdamOp {
  // The lists of a block, by name, in the order run_update forms them: params, grads, the plan's
  // state (AdamPlan: exp_avgs, exp_avg_sqs, max_exp_avg_sqs when amsgrad), master params.
  static constexpr int kParams = 0;
  static constexpr int kGrads = 1;
  static constexpr int kExpAvgs = 2;
  static constexpr int kExpAvgSqs = 3;
  static constexpr int kMaxExpAvgSqs = 4;  // with kAmsgrad only
  static constexpr int kMasterList = 4 + (kAmsgrad ? 1 : 0);
  static constexpr int kDepth = kMasterList + (kMaster ? 1 : 0);

  AdamHyper h;
  StepScalars s;       // device pointers, each may be null
  const float* steps;  // old step of each param, by list position
  double lr;           // used when s.lr is null

  template <typename T>
  __device__ void apply(const MtaBlock<kDepth>& blk) const {
    if constexpr (!std::is_same_v<T, double>) {  // params are never float64 (check_step)
      using S = std::conditional_t<kMaster, float, T>;
      if (step_skipped(s.found_inf)) return;  // same value in every thread: the whole block leaves
      // The coefficients need double pow: one thread computes them and shares them.
      __shared__ AdamCoefs coefs_shared;
      if (threadIdx.x == 0) {
        const double lr_v = s.lr != nullptr ? static_cast<double>(*s.lr) : lr;
        coefs_shared = adam_coefs(h, lr_v, static_cast<double>(steps[blk.index]) + 1.0);
      }
      __syncthreads();
      const AdamCoefs c = coefs_shared;
      const float inv = s.inv_scale != nullptr ? *s.inv_scale : 1.0f;
      const float coef = s.clip_coef != nullptr ? *s.clip_coef : 1.0f;

      T* const p = blk.template ptr<T>(kParams);
      const T* const g = blk.template ptr<T>(kGrads);
      S* const m = blk.template ptr<S>(kExpAvgs);
      S* const v = blk.template ptr<S>(kExpAvgSqs);
      // Lists that the instantiation does not have are never formed (their slot may not exist).
      S* vm = nullptr;
      if constexpr (kAmsgrad) vm = blk.template ptr<S>(kMaxExpAvgSqs);
      float* mp = nullptr;
      if constexpr (kMaster) mp = blk.template ptr<float>(kMasterList);
      bool aligned = pack_aligned(g) && pack_aligned(m) && pack_aligned(v);
      if constexpr (kMaster) aligned = aligned && pack_aligned(mp);
      if constexpr (kAmsgrad) aligned = aligned && pack_aligned(vm);
      aligned = aligned && pack_aligned(p);

      const int n = blk.len;
      for (int e = static_cast<int>(threadIdx.x) * kPack; e < n; e += kMtaThreads * kPack) {
        const int valid = n - e < kPack ? n - e : kPack;
        const bool vec = aligned && valid == kPack;
        float pr[kPack], gr[kPack], mr[kPack], vr[kPack], vmr[kPack];
        if constexpr (kMaster) {
          load_pack(mp, e, valid, vec, pr);  // the fp32 master is the parameter; p is its copy
        } else {
          load_pack(p, e, valid, vec, pr);
        }
        load_pack(g, e, valid, vec, gr);
        load_pack(m, e, valid, vec, mr);
        load_pack(v, e, valid, vec, vr);
        if constexpr (kAmsgrad) {
          load_pack(vm, e, valid, vec, vmr);
        } else {
#pragma unroll
          for (int j = 0; j < kPack; ++j) vmr[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
          adam_update(pr[j], prep_grad(gr[j], inv, coef, h.maximize), mr[j], vr[j], vmr[j], h, c);
        }
        store_pack(m, e, valid, vec, mr);
        store_pack(v, e, valid, vec, vr);
        if constexpr (kAmsgrad) store_pack(vm, e, valid, vec, vmr);
        if constexpr (kMaster) store_pack(mp, e, valid, vec, pr);
        store_pack(p, e, valid, vec, pr);
      }
    }
  }
};

template <bool kMomentum, bool kMaster>
struct SgdOp {
  // The lists of a block, by name, in the order run_update forms them: params, grads, the plan's
  // state (SgdPlan: momentum_buffers when momentum != 0), master params.
  static constexpr int kParams = 0;
  static constexpr int kGrads = 1;
  static constexpr int kMomentumBuffers = 2;  // with kMomentum only
  static constexpr int kMasterList = 2 + (kMomentum ? 1 : 0);
  static constexpr int kDepth = kMasterList + (kMaster ? 1 : 0);

  SgdHyper h;
  StepScalars s;
  const float* steps;  // old step of each param (0: the momentum buffer is still unset)
  double lr;

  template <typename T>
  __device__ void apply(const MtaBlock<kDepth>& blk) const {
    if constexpr (!std::is_same_v<T, double>) {
      using S = std::conditional_t<kMaster, float, T>;
      if (step_skipped(s.found_inf)) return;
      const float neg_lr = static_cast<float>(-(s.lr != nullptr ? static_cast<double>(*s.lr) : lr));
      const bool first = steps[blk.index] == 0.0f;
      const float inv = s.inv_scale != nullptr ? *s.inv_scale : 1.0f;
      const float coef = s.clip_coef != nullptr ? *s.clip_coef : 1.0f;

      T* const p = blk.template ptr<T>(kParams);
      const T* const g = blk.template ptr<T>(kGrads);
      S* buf = nullptr;
      if constexpr (kMomentum) buf = blk.template ptr<S>(kMomentumBuffers);
      float* mp = nullptr;
      if constexpr (kMaster) mp = blk.template ptr<float>(kMasterList);
      bool aligned = pack_aligned(p) && pack_aligned(g);
      if constexpr (kMomentum) aligned = aligned && pack_aligned(buf);
      if constexpr (kMaster) aligned = aligned && pack_aligned(mp);

      const int n = blk.len;
      for (int e = static_cast<int>(threadIdx.x) * kPack; e < n; e += kMtaThreads * kPack) {
        const int valid = n - e < kPack ? n - e : kPack;
        const bool vec = aligned && valid == kPack;
        float pr[kPack], gr[kPack], br[kPack];
        if constexpr (kMaster) {
          load_pack(mp, e, valid, vec, pr);
        } else {
          load_pack(p, e, valid, vec, pr);
        }
        load_pack(g, e, valid, vec, gr);
        if constexpr (kMomentum) {
          load_pack(buf, e, valid, vec, br);
        } else {
#pragma unroll
          for (int j = 0; j < kPack; ++j) br[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kPack; ++j) {
          sgd_update(pr[j], prep_grad(gr[j], inv, coef, h.maximize), br[j], neg_lr, h, first);
        }
        if constexpr (kMomentum) store_pack(buf, e, valid, vec, br);
        if constexpr (kMaster) store_pack(mp, e, valid, vec, pr);
        store_pack(p, e, valid, vec, pr);
      }
    }
  }
};

// --- host side ----------------------------------------------------------------------------------

void adam_step_cuda(const AdamArgs& args) {
  const StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const AdamHyper h = args.opt.hyper();
  const double lr = args.opt.lr;
  run_step(AdamArgs::kOp, plan, args.state_steps, dev, [&](const float* old_steps) {
    with_bools(args.opt.amsgrad, plan.has_master, [&](auto ams, auto master) {
      using Op = AdamOp<decltype(ams)::value, decltype(master)::value>;
      run_update(plan, Op{h, dev, old_steps, lr});
    });
  });
}

void sgd_step_cuda(const SgdArgs& args) {
  const StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const SgdHyper h = args.opt.hyper();
  const double lr = args.opt.lr;
  run_step(SgdArgs::kOp, plan, args.state_steps, dev, [&](const float* old_steps) {
    with_bools(args.opt.momentum != 0.0, plan.has_master, [&](auto mom, auto master) {
      using Op = SgdOp<decltype(mom)::value, decltype(master)::value>;
      run_update(plan, Op{h, dev, old_steps, lr});
    });
  });
}

}  // namespace
}  // namespace optim
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  namespace o = fastamp::optim;
  m.impl("adam_step_", TORCH_BOX(&o::adam_step_op<o::adam_step_cuda>));
  m.impl("sgd_step_", TORCH_BOX(&o::sgd_step_op<o::sgd_step_cuda>));
  m.impl("adam_step_held_", TORCH_BOX(&o::adam_step_held_op<o::adam_step_cuda>));
  m.impl("sgd_step_held_", TORCH_BOX(&o::sgd_step_held_op<o::sgd_step_cuda>));
}
