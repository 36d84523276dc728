/// @file scaler_math.h
/// Element and scalar math of the GradScaler ops, written once and compiled into both the CPU
/// kernels and the CUDA kernels. CPU tests of this math therefore cover the CUDA arithmetic too.
#pragma once

#include "common/amp_math.h"
#include "common/macros.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

// The CPU kernels are compiled once per instruction set (see scaler_cpu_kernels.h). An inline
// namespace per build gives each copy of these inline functions its own symbols, so the linker can
// never pick an AVX2-compiled copy for the baseline kernels (an ODR trap otherwise).
#ifndef FASTAMP_CPU_NS
#define FASTAMP_CPU_NS cap_default
#endif

namespace fastamp {
namespace scaler {
inline namespace FASTAMP_CPU_NS {

/// Which norm the read-only stats pass accumulates.
enum class NormKind : int32_t {
  kL2 = 0,   ///< sum of squares
  kInf = 1,  ///< max of |x|
  kL1 = 2,   ///< sum of |x|
  kLp = 3,   ///< sum of |x|^p
};

/// Calls f(std::integral_constant<NormKind, K>{}) for the runtime kind, so kernels are templated
/// on the norm (no per-element branch) without each backend spelling out the switch.
template <typename F>
inline void visit_norm_kind(NormKind kind, F&& f) {
  switch (kind) {
    case NormKind::kL2:
      f(std::integral_constant<NormKind, NormKind::kL2>{});
      break;
    case NormKind::kInf:
      f(std::integral_constant<NormKind, NormKind::kInf>{});
      break;
    case NormKind::kL1:
      f(std::integral_constant<NormKind, NormKind::kL1>{});
      break;
    case NormKind::kLp:
      f(std::integral_constant<NormKind, NormKind::kLp>{});
      break;
  }
}

inline NormKind norm_kind_of(double p) {
  if (std::isinf(p)) return NormKind::kInf;
  if (p == 2.0) return NormKind::kL2;
  if (p == 1.0) return NormKind::kL1;
  return NormKind::kLp;
}

/// 0 for finite v, NaN for +-inf and NaN. Summing these is a branch-free, vectorisable
/// non-finite test (no -ffast-math anywhere in this project, so v - v is not folded to 0).
template <typename T>
FASTAMP_HOST_DEVICE inline T nonfinite_probe(T v) {
  return v - v;
}

/// The unscaled value, computed exactly as torch._amp_foreach_non_finite_check_and_unscale_ does:
/// one multiply by the fp32 reciprocal of the scale, in the op-math type (fp32 for half types).
template <typename opmath_t>
FASTAMP_HOST_DEVICE inline opmath_t unscale(opmath_t v, float inv_scale) {
  return v * inv_scale;
}

/// One element's contribution to the norm accumulator.
template <NormKind K>
FASTAMP_HOST_DEVICE inline float norm_term(float u, float p) {
  if constexpr (K == NormKind::kL2) {
    (void)p;
    return u * u;
  } else if constexpr (K == NormKind::kL1 || K == NormKind::kInf) {
    (void)p;
    return std::fabs(u);
  } else {
    return std::pow(std::fabs(u), p);
  }
}

/// Combines two accumulators: a sum, or a NaN-propagating max for the inf-norm.
template <NormKind K>
FASTAMP_HOST_DEVICE inline float norm_combine(float a, float b) {
  if constexpr (K == NormKind::kInf) {
    return (a > b || a != a) ? a : b;
  } else {
    return a + b;
  }
}

/// Clip coefficient of torch.nn.utils.clip_grad_norm_: max_norm / (total_norm + 1e-6), clamped
/// to at most 1, rounded as torch rounds it: ``max_norm / tensor`` is ``tensor.reciprocal() *
/// max_norm`` (Tensor.__rtruediv__), two fp32 roundings, not one division (which differs in the
/// last bit for about half the norms when max_norm is not a power of two). A NaN norm gives a
/// NaN coefficient, as torch.clamp does.
FASTAMP_HOST_DEVICE inline float clip_coef(float total_norm, float max_norm) {
  const float r = 1.0f / (total_norm + 1e-6f);
  const float c = r * max_norm;
  return c > 1.0f ? 1.0f : c;
}

/// The norm from its power sum for the norms fastamp::clip_coef takes: the IEEE square root for
/// norm_type 2 (torch's Tensor.sqrt), the sum (norm_type 1) or max (inf) itself otherwise.
FASTAMP_HOST_DEVICE inline float norm_root(float pow_sum, bool l2) {
  return l2 ? std::sqrt(pow_sum) : pow_sum;
}

/// Dynamic loss-scale update.
///
/// With hysteresis == 1, min_scale == 0 and max_scale == inf this is exactly
/// torch._amp_update_scale_:
///   overflow:    scale *= backoff_factor, growth_tracker = 0
///   otherwise:   ++growth_tracker; when it reaches growth_interval, scale *= growth_factor unless
///   that
///                overflows fp32, and growth_tracker = 0.
/// Hysteresis (as in Megatron-LM): each overflow decrements hysteresis_tracker and the scale backs
/// off only once it is <= 0; a growth resets it to `hysteresis`. The scale is clamped to
/// [min_scale, max_scale] and never becomes inf.
/// The trackers are stepped in 64-bit: a tracker at an int32 limit (a state this rule never
/// produces, but one a caller can load) must not overflow, which would be undefined behaviour.
/// The growth tracker saturates at INT32_MAX; a backoff resets the hysteresis tracker to 0.
FASTAMP_HOST_DEVICE inline void update_scale(float* scale, int32_t* growth_tracker,
                                             int32_t* hysteresis_tracker, float found_inf,
                                             double growth_factor, double backoff_factor,
                                             int64_t growth_interval, int64_t hysteresis,
                                             double min_scale, double max_scale) {
  if (found_inf != 0.0f) {
    *growth_tracker = 0;
    const int64_t left = static_cast<int64_t>(*hysteresis_tracker) - 1;
    if (left <= 0) {
      // float * double, rounded to float: the same arithmetic as PyTorch's kernel.
      float s = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
      if (static_cast<double>(s) < min_scale) s = static_cast<float>(min_scale);
      *scale = s;
      *hysteresis_tracker = 0;
    } else {
      *hysteresis_tracker = static_cast<int32_t>(left);
    }
  } else {
    const int64_t successful = static_cast<int64_t>(*growth_tracker) + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      if (!std::isinf(grown)) {
        *scale = static_cast<double>(grown) > max_scale ? static_cast<float>(max_scale) : grown;
      }
      *growth_tracker = 0;
      *hysteresis_tracker = static_cast<int32_t>(hysteresis);  // <= INT32_MAX: checked
    } else {
      *growth_tracker = static_cast<int32_t>(successful > INT32_MAX ? INT32_MAX : successful);
    }
  }
}

}  // namespace FASTAMP_CPU_NS
}  // namespace scaler
}  // namespace fastamp
