/// @file optim_cpu_kernels.h
/// Per-chunk CPU kernels of the fused optimizers, compiled once per instruction set (as the
/// scaler's: optim_cpu_kernels_<isa>.cpp include optim_cpu_kernels.inc).
#pragma once

#include "common/torch_api.h"

#include <cstdint>

#include "optim/lowbit_math.h"
#include "optim/optim_math.h"

namespace fastamp {
namespace optim {

/// One chunk of one param: `n` elements at the given (already offset) pointers. State tensors are
/// float32 when `master` is set, else of the param's dtype.
struct AdamChunk {
  c10::ScalarType dtype;
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  ///< null unless amsgrad
  float* master;         ///< null unless master weights
  int64_t n;
  float inv_scale;
  float clip_coef;
};

struct SgdChunk {
  c10::ScalarType dtype;
  void* param;
  const void* grad;
  void* momentum_buffer;  ///< null when momentum == 0
  float* master;
  int64_t n;
  float inv_scale;
  float clip_coef;
  float neg_lr;
  bool first;
  int64_t start = 0;  ///< sgd_bf16: index of the chunk's first element (the rounding's counter)
  uint32_t key = 0;   ///< sgd_bf16: sr_key of the tensor at this update
};

/// One chunk of one param of fastamp::adam_lowbit_step_: bfloat16 moments (`exp_avg`,
/// `exp_avg_sq` point at uint16 bits) or 8-bit codes (uint8, with the block scales at
/// `m_absmax` / `v_absmax`, offset to the chunk's first 256-element block).
struct AdamLowbitChunk {
  c10::ScalarType dtype;
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  float* m_absmax;  ///< null unless 8-bit
  float* v_absmax;
  float* master;  ///< null unless master weights
  int64_t n;
  int64_t start;  ///< index of the chunk's first element in its tensor (the rounding's counter)
  uint32_t key;   ///< sr_key of the tensor at this step (bfloat16 state)
  float inv_scale;
  float clip_coef;
};

struct OptimCpuKernels {
  void (*adam)(const AdamChunk&, const AdamHyper&, const AdamCoefs&);
  void (*sgd)(const SgdChunk&, const SgdHyper&);
  void (*adam_bf16)(const AdamLowbitChunk&, const AdamHyper&, const AdamCoefs&);
  void (*adam_q8)(const AdamLowbitChunk&, const AdamHyper&, const AdamCoefs&);
  /// SGD with a bfloat16 momentum buffer (`momentum_buffer` points at its uint16 bits), written
  /// with stochastic rounding (the low 16 of sr_bits).
  void (*sgd_bf16)(const SgdChunk&, const SgdHyper&);
};

const OptimCpuKernels& optim_cpu_kernels_default();
#if defined(__x86_64__) || defined(_M_X64)
const OptimCpuKernels& optim_cpu_kernels_avx2();
const OptimCpuKernels& optim_cpu_kernels_avx512();
#endif
const OptimCpuKernels& optim_cpu_kernels();

}  // namespace optim
}  // namespace fastamp
