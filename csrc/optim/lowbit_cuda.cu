// CUDA kernel of fastamp::adam_lowbit_step_: Adam/AdamW with bfloat16 (stochastically rounded) or
// 8-bit block-quantized moments, on the multi-tensor engine, in the same three stream-ordered
// passes as adam_step_ (optim_cuda.cu's header). The element math is lowbit_math.h's and
// optim_math.h's, shared with the CPU kernels, so the emulated kernel is compared bit for bit.
//
// List layout: 0 params (T), 1 grads (T), 2 exp_avgs, 3 exp_avg_sqs (uint16 bits of bfloat16, or
// uint8 codes), [master_params (float32)], then, for 8-bit codes, the side lists exp_avg_absmax
// and exp_avg_sq_absmax (float32, one per 256-element block: MtaBlock::side_ptr).
//
// 8-bit: each of the 512 threads takes one element of two consecutive 256-element blocks per
// iteration; the new absmax of each block is a max over its 256 threads (warp shuffles, then the
// 8 warp values in shared memory), which is exact in any order, as on the CPU.
#include "common/torch_api.h"

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "optim/lowbit_math.h"
#include "optim/optim_checks.h"
#include "optim/optim_cuda.cuh"
#include "optim/optim_math.h"

#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace fastamp {
namespace optim {
namespace {

static_assert(kQuantBlock == kMtaSideBlock, "the engine's side lists are the quantization blocks");
static_assert(kMtaThreads % kQuantBlock == 0, "whole quantization blocks per iteration");

template <bool kInt8, bool kMaster>
struct AdamLowbitOp {
  static constexpr int kCodes = 4;  // lists before master/side
  static constexpr int kMasterList = kCodes;
  static constexpr int kSide = kInt8 ? 2 : 0;
  static constexpr int kDepth = kCodes + (kMaster ? 1 : 0) + kSide;
  static constexpr int kAbsmaxM = kCodes + (kMaster ? 1 : 0);

  AdamHyper h;
  StepScalars s;
  const float* steps;  // old step of each param, by list position
  double lr;
  uint32_t seed;

  template <typename T>
  __device__ void apply(const MtaBlock<kDepth>& blk) const {
    if constexpr (!std::is_same_v<T, double>) {  // params are never float64 (the op's checks)
      if (step_skipped(s.found_inf)) return;     // same in every thread: the block leaves
      __shared__ AdamCoefs coefs_shared;
      __shared__ uint32_t key_shared;
      if (threadIdx.x == 0) {
        const double lr_v = s.lr != nullptr ? static_cast<double>(*s.lr) : lr;
        const float old = steps[blk.index];
        coefs_shared = adam_coefs(h, lr_v, static_cast<double>(old) + 1.0);
        key_shared =
            sr_key(seed, static_cast<uint32_t>(old + 1.0f), static_cast<uint32_t>(blk.index));
      }
      __syncthreads();
      const AdamCoefs c = coefs_shared;
      const uint32_t key = key_shared;
      const float inv = s.inv_scale != nullptr ? *s.inv_scale : 1.0f;
      const float coef = s.clip_coef != nullptr ? *s.clip_coef : 1.0f;
      T* const p = blk.template ptr<T>(0);
      const T* const g = blk.template ptr<T>(1);
      float* mp = nullptr;
      if constexpr (kMaster) mp = blk.template ptr<float>(kMasterList);
      if constexpr (kInt8) {
        update_int8<T>(blk, p, g, mp, c, inv, coef);
      } else {
        uint16_t* const m = blk.template ptr<uint16_t>(2);
        uint16_t* const v = blk.template ptr<uint16_t>(3);
        for (int e = static_cast<int>(threadIdx.x); e < blk.len; e += kMtaThreads) {
          float pi = kMaster ? mp[e] : static_cast<float>(p[e]);
          float mi = bf16_bits_float(m[e]);
          float vi = bf16_bits_float(v[e]);
          float unused = 0.0f;
          adam_update(pi, prep_grad(static_cast<float>(g[e]), inv, coef, h.maximize), mi, vi,
                      unused, h, c);
          const uint32_t r = sr_bits(key, blk.start + e);
          m[e] = bf16_stochastic(mi, r);
          v[e] = bf16_stochastic(vi, r >> 16);
          if constexpr (kMaster) mp[e] = pi;
          p[e] = static_cast<T>(pi);
        }
      }
    }
  }

  template <typename T>
  __device__ void update_int8(const MtaBlock<kDepth>& blk, T* p, const T* g, float* mp,
                              const AdamCoefs& c, float inv, float coef) const {
    constexpr int kWarps = kMtaThreads / 32;
    constexpr int kWarpsPerBlock = kQuantBlock / 32;
    // The maxima as the bit patterns of |m| and v (max_bits: the CPU kernels' integer maximum, so
    // a NaN that reached the state, a NaN gradient stepped without a scaler, wins on both).
    __shared__ uint32_t warp_m[kWarps];
    __shared__ uint32_t warp_v[kWarps];
    uint8_t* const mq = blk.template ptr<uint8_t>(2);
    uint8_t* const vq = blk.template ptr<uint8_t>(3);
    float* const am = blk.template side_ptr<float>(kAbsmaxM);
    float* const av = blk.template side_ptr<float>(kAbsmaxM + 1);
    const int t = static_cast<int>(threadIdx.x);
    const int lane = t & 31;
    const int warp = t >> 5;
    // Every thread runs every iteration (the barriers and shuffles need all of them); threads
    // past the chunk's end carry 0, the identity of these maxima.
    for (int base = 0; base < blk.len; base += kMtaThreads) {
      const int e = base + t;
      const bool live = e < blk.len;
      const int qb = e / kQuantBlock;  // block within the chunk
      float mi = 0.0f;
      float vi = 0.0f;
      if (live) {
        mi = decode_m8(mq[e]) * am[qb];
        vi = decode_v8(vq[e]) * av[qb];
        float pi = kMaster ? mp[e] : static_cast<float>(p[e]);
        float unused = 0.0f;
        adam_update(pi, prep_grad(static_cast<float>(g[e]), inv, coef, h.maximize), mi, vi, unused,
                    h, c);
        if constexpr (kMaster) mp[e] = pi;
        p[e] = static_cast<T>(pi);
      }
      uint32_t wm = live ? (float_bits(mi) & 0x7FFFFFFFu) : 0u;
      uint32_t wv = live ? (float_bits(vi) & 0x7FFFFFFFu) : 0u;
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        wm = max_bits(__shfl_xor_sync(0xffffffffu, wm, off), wm);
        wv = max_bits(__shfl_xor_sync(0xffffffffu, wv, off), wv);
      }
      if (lane == 0) {
        warp_m[warp] = wm;
        warp_v[warp] = wv;
      }
      __syncthreads();
      const int first = (warp / kWarpsPerBlock) * kWarpsPerBlock;
      uint32_t mbits = 0u;
      uint32_t vbits = 0u;
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        mbits = max_bits(warp_m[first + w], mbits);
        vbits = max_bits(warp_v[first + w], vbits);
      }
      const float mmax = bits_float(canonical_max(mbits));
      const float vmax = bits_float(canonical_max(vbits));
      if (live) {
        mq[e] = encode_m8(mi * block_reciprocal(mmax));
        vq[e] = encode_v8(vi * block_reciprocal(vmax));
        if (e % kQuantBlock == 0) {  // the block's first element writes its scales
          am[qb] = mmax;
          av[qb] = vmax;
        }
      }
      __syncthreads();  // the next iteration overwrites warp_m / warp_v
    }
  }
};

// SGD with a bfloat16 momentum buffer: sgd_update per element, the buffer rounded stochastically
// (the low half of sr_bits, as the CPU kernel). Lists: params, grads, buffers, [master].
template <bool kMaster>
struct SgdLowbitOp {
  static constexpr int kDepth = 3 + (kMaster ? 1 : 0);
  static constexpr int kMasterList = 3;

  SgdHyper h;
  StepScalars s;
  const float* steps;  // old update count of each param (0: the buffer gets the gradient)
  double lr;
  uint32_t seed;

  template <typename T>
  __device__ void apply(const MtaBlock<kDepth>& blk) const {
    if constexpr (!std::is_same_v<T, double>) {
      if (step_skipped(s.found_inf)) return;
      const float old = steps[blk.index];
      const bool first = old == 0.0f;
      // Every thread computes the same key (a few integer operations; no barrier needed).
      const uint32_t key =
          sr_key(seed, static_cast<uint32_t>(old + 1.0f), static_cast<uint32_t>(blk.index));
      const float neg_lr = static_cast<float>(-(s.lr != nullptr ? static_cast<double>(*s.lr) : lr));
      const float inv = s.inv_scale != nullptr ? *s.inv_scale : 1.0f;
      const float coef = s.clip_coef != nullptr ? *s.clip_coef : 1.0f;
      T* const p = blk.template ptr<T>(0);
      const T* const g = blk.template ptr<T>(1);
      uint16_t* const buf = blk.template ptr<uint16_t>(2);
      float* mp = nullptr;
      if constexpr (kMaster) mp = blk.template ptr<float>(kMasterList);
      for (int e = static_cast<int>(threadIdx.x); e < blk.len; e += kMtaThreads) {
        float pi = kMaster ? mp[e] : static_cast<float>(p[e]);
        float bi = bf16_bits_float(buf[e]);
        sgd_update(pi, prep_grad(static_cast<float>(g[e]), inv, coef, h.maximize), bi, neg_lr, h,
                   first);
        buf[e] = bf16_stochastic(bi, sr_bits(key, blk.start + e));
        if constexpr (kMaster) mp[e] = pi;
        p[e] = static_cast<T>(pi);
      }
    }
  }
};

void sgd_lowbit_step_cuda(const SgdLowbitArgs& args) {
  const StepPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const SgdHyper h = args.opt.hyper();
  const double lr = args.opt.lr;
  const auto seed = static_cast<uint32_t>(args.seed);
  run_step(SgdLowbitArgs::kOp, plan, args.state_steps, dev, [&](const float* old_steps) {
    with_bool(plan.has_master, [&](auto master) {
      using Op = SgdLowbitOp<decltype(master)::value>;
      run_update(plan, Op{h, dev, old_steps, lr, seed});
    });
  });
}

void adam_lowbit_step_cuda(const AdamLowbitArgs& args) {
  const LowbitPlan plan = check_args(args);
  if (plan.empty()) return;
  const StepScalars& dev = plan.scalars;
  const AdamHyper h = args.opt.hyper();
  const double lr = args.opt.lr;
  const auto seed = static_cast<uint32_t>(args.seed);
  run_step(AdamLowbitArgs::kOp, plan, args.state_steps, dev, [&](const float* old_steps) {
    with_bools(plan.int8, plan.has_master, [&](auto int8, auto master) {
      using Op = AdamLowbitOp<decltype(int8)::value, decltype(master)::value>;
      run_update<Op::kSide>(plan, Op{h, dev, old_steps, lr, seed}, plan.absmax);
    });
  });
}

}  // namespace
}  // namespace optim
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  namespace o = fastamp::optim;
  m.impl("adam_lowbit_step_", TORCH_BOX(&o::adam_lowbit_step_op<o::adam_lowbit_step_cuda>));
  m.impl("sgd_lowbit_step_", TORCH_BOX(&o::sgd_lowbit_step_op<o::sgd_lowbit_step_cuda>));
  m.impl("adam_lowbit_step_held_",
         TORCH_BOX(&o::adam_lowbit_step_held_op<o::adam_lowbit_step_cuda>));
  m.impl("sgd_lowbit_step_held_", TORCH_BOX(&o::sgd_lowbit_step_held_op<o::sgd_lowbit_step_cuda>));
}
