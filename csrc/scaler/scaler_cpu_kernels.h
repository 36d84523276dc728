/// @file scaler_cpu_kernels.h
/// Per-chunk CPU kernels of the scaler ops, compiled once per instruction set.
///
/// scaler_cpu_kernels_default.cpp builds them for the x86-64 baseline, and
/// scaler_cpu_kernels_avx2.cpp with -mavx2 -mfma -mf16c; scaler_cpu.cpp picks a table at load time
/// from what the CPU supports (FASTAMP_CPU_CAPABILITY=default forces the baseline). The loops are
/// written for the auto-vectoriser: fixed-width lanes of independent accumulators, no branches.
#pragma once

#include "common/torch_api.h"

#include <cstdint>

#include "scaler/scaler_math.h"

namespace fastamp {
namespace scaler {

/// The chunk kernels of one instruction set. Pointers are the chunk's first element.
struct CpuKernels {
  // kind is a NormKind: passed as an int because NormKind lives in a per-ISA inline namespace.
  void (*stats)(c10::ScalarType dtype, int32_t kind, const void* x, int64_t n, float inv_scale,
                float p, float* acc_out, bool* nonfinite_out);
  // stats of src while copying it unchanged to dst: equal to stats over dst after the copy.
  void (*copy_stats)(c10::ScalarType dtype, int32_t kind, const void* src, void* dst, int64_t n,
                     float inv_scale, float p, float* acc_out, bool* nonfinite_out);
  bool (*unscale)(c10::ScalarType dtype, void* x, int64_t n, float inv_scale);
  void (*clip_unscale)(c10::ScalarType dtype, void* x, int64_t n, float inv_scale, float coef);
};

const CpuKernels& cpu_kernels_default();
#if defined(__x86_64__) || defined(_M_X64)
const CpuKernels& cpu_kernels_avx2();
#endif

/// The table for this CPU (AVX2+FMA+F16C when available).
const CpuKernels& cpu_kernels();

}  // namespace scaler
}  // namespace fastamp
