/// @file cpu_convert.h
/// fp32 <-> storage-type conversions for the CPU kernels, compiled per instruction set.
///
/// Include only from a per-ISA kernel file (one that defines FASTAMP_CPU_NS): these are c10's
/// conversions re-implemented so that each ISA's copy lives in its own inline namespace; c10's
/// inline ones could be merged by the linker with a copy built for another ISA.
#pragma once

#include "common/torch_api.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "common/amp_math.h"

#ifndef FASTAMP_CPU_NS
#error "cpu_convert.h is for the per-ISA kernel files, which define FASTAMP_CPU_NS"
#endif

namespace fastamp {
inline namespace FASTAMP_CPU_NS {
namespace cpu {

using ::fastamp::opmath_t;  // common/amp_math.h

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

template <typename T>
inline opmath_t<T> load(const T& x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bits_to_float(static_cast<uint32_t>(x.x) << 16);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(__F16C__)
    return _cvtsh_ss(x.x);
#else
    return static_cast<float>(x);
#endif
  } else {
    return x;
  }
}

template <typename T>
inline T store(opmath_t<T> v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Round to nearest even, NaN kept quiet: the rounding of c10::BFloat16(float).
    const uint32_t b = float_to_bits(v);
    c10::BFloat16 out;
    out.x =
        v != v ? uint16_t{0x7fc0} : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    return out;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(__F16C__)
    c10::Half out;
    out.x = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    return out;
#else
    return static_cast<c10::Half>(v);
#endif
  } else {
    return v;
  }
}

/// Calls f(static_cast<T*>(nullptr)) for the storage type T of `dtype` (float, double, half, bf16).
template <typename F>
inline void dispatch_float_types(c10::ScalarType dtype, const F& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      f(static_cast<float*>(nullptr));
      break;
    case c10::ScalarType::Double:
      f(static_cast<double*>(nullptr));
      break;
    case c10::ScalarType::Half:
      f(static_cast<c10::Half*>(nullptr));
      break;
    case c10::ScalarType::BFloat16:
      f(static_cast<c10::BFloat16*>(nullptr));
      break;
    default:
      FASTAMP_ASSERT(false, "fastamp: unexpected dtype ", dtype);
  }
}

}  // namespace cpu
}  // namespace FASTAMP_CPU_NS
}  // namespace fastamp
