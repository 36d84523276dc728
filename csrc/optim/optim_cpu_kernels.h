/// @file optim_cpu_kernels.h
/// Per-chunk CPU kernels of the fused optimizers, compiled once per instruction set (as the
/// scaler's: optim_cpu_kernels_<isa>.cpp include optim_cpu_kernels.inc).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

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
};

struct OptimCpuKernels {
  const char* name;
  void (*adam)(const AdamChunk&, const AdamHyper&, const AdamCoefs&);
  void (*sgd)(const SgdChunk&, const SgdHyper&);
};

const OptimCpuKernels& optim_cpu_kernels_default();
#if defined(__x86_64__) || defined(_M_X64)
const OptimCpuKernels& optim_cpu_kernels_avx2();
#endif
const OptimCpuKernels& optim_cpu_kernels();

}  // namespace optim
}  // namespace fastamp
