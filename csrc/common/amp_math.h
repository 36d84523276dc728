/// @file amp_math.h
/// What every capability's kernels share, written once for the CPU and CUDA builds: the op-math
/// type, the unscale + clip of a loss-scaled gradient (the scaler's clip pass, the optimizers'
/// update and the bucket unpack all read gradients through it), and the compile-time dispatch of
/// runtime flags.
#pragma once

#include "common/macros.h"

#include <type_traits>

// Compiled once per instruction set on the CPU (see scaler_math.h for why the inline namespace).
#ifndef FASTAMP_CPU_NS
#define FASTAMP_CPU_NS cap_default
#endif

namespace fastamp {

/// The type element math runs in: fp32 for float and the half types, double for double.
template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

inline namespace FASTAMP_CPU_NS {

/// Unscale and clip one value in registers: (v * inv_scale) * coef, the two roundings of the
/// unscale_ + clip_grad_norm_ recipe for fp32, but a single rounding to the storage type.
template <typename Op>
FASTAMP_HOST_DEVICE inline Op unscale_clip(Op v, float inv_scale, float coef) {
  return (v * inv_scale) * coef;
}

/// Calls f(std::bool_constant<a>): a runtime flag becomes a template parameter, so the element
/// loops carry no per-element branch on it.
template <typename F>
inline void with_bool(bool a, const F& f) {
  if (a) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

/// Calls f(std::bool_constant<a>, std::bool_constant<b>): runtime flags become template
/// parameters, so the element loops carry no per-element branch on them.
template <typename F>
inline void with_bools(bool a, bool b, const F& f) {
  if (a) {
    if (b) {
      f(std::true_type{}, std::true_type{});
    } else {
      f(std::true_type{}, std::false_type{});
    }
  } else if (b) {
    f(std::false_type{}, std::true_type{});
  } else {
    f(std::false_type{}, std::false_type{});
  }
}

}  // namespace FASTAMP_CPU_NS
}  // namespace fastamp
