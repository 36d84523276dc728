/// @file cpu_simd.h
/// SIMD vectors for the CPU kernels that the compiler does not vectorise by itself: GCC/Clang
/// vector extensions sized for the instruction set the translation unit is built for (16 float
/// lanes with AVX-512, 8 with AVX2, 4 otherwise). Arithmetic on them is plain C++ operators, lane
/// by lane with the usual IEEE rounding (-ffp-contract=off fuses nothing), so a kernel written on
/// them runs the same shared element math (optim_math.h, lowbit_math.h) as the scalar code and
/// gives the same bits. Only what the operators cannot say is here: loads and stores, widening and
/// narrowing conversions, and taking the high 16-bit halves of two vectors of 32-bit lanes.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "common/macros.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FASTAMP_SIMD_X86 1
#else
#define FASTAMP_SIMD_X86 0
#endif

#ifndef FASTAMP_CPU_NS
#define FASTAMP_CPU_NS cap_default
#endif

namespace fastamp {
namespace cpu {
inline namespace FASTAMP_CPU_NS {
namespace simd {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

// kLanes lanes of 32 bits.
typedef float f32 __attribute__((vector_size(4 * kLanes)));
typedef uint32_t u32 __attribute__((vector_size(4 * kLanes)));
typedef uint16_t u16h __attribute__((vector_size(2 * kLanes)));  // kLanes lanes of 16 bits
typedef uint8_t u8q __attribute__((vector_size(kLanes)));        // kLanes lanes of 8 bits
// 2 * kLanes lanes: the 16-bit halves of two u32 vectors, and their narrowing to bytes.
typedef uint16_t u16 __attribute__((vector_size(4 * kLanes)));
typedef uint8_t u8 __attribute__((vector_size(2 * kLanes)));

#if FASTAMP_SIMD_X86 && defined(__AVX512F__)
// The all-lanes mask: GCC 12's unmasked AVX-512 conversions start from _mm512_undefined_epi32()
// and trip -Wmaybe-uninitialized; the zero-masked forms with every lane set are the same
// instruction.
constexpr __mmask16 kAll = 0xFFFF;
#endif

template <class V, class P>
inline V load(const P* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <class V, class P>
inline void store(P* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

/// kLanes bytes at p, zero-extended to 32-bit lanes. (GCC 12 turns __builtin_convertvector of
/// bytes into one insert per lane, hence the intrinsics.)
inline u32 widen_bytes(const uint8_t* p) {
#if FASTAMP_SIMD_X86 && defined(__AVX512F__)
  return (u32)_mm512_maskz_cvtepu8_epi32(kAll,
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif FASTAMP_SIMD_X86 && defined(__AVX2__)
  return (u32)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(load<u8q>(p), u32);
#endif
}

/// kLanes 16-bit values at p, zero-extended to 32-bit lanes.
inline u32 widen_halves(const uint16_t* p) {
#if FASTAMP_SIMD_X86 && defined(__AVX512F__)
  return (u32)_mm512_maskz_cvtepu16_epi32(kAll,
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif FASTAMP_SIMD_X86 && defined(__AVX2__)
  return (u32)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(load<u16h>(p), u32);
#endif
}

/// 0, 1, ..., kLanes - 1.
inline u32 iota() {
  u32 r;
  for (int i = 0; i < kLanes; ++i) r[i] = static_cast<uint32_t>(i);
  return r;
}

namespace detail {
template <std::size_t... I>
inline u16 odd_halves(u16 a, u16 b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I + 1)...);
}
}  // namespace detail

/// The high 16 bits of every 32-bit lane of a, then of b (little-endian: the odd 16-bit lanes).
inline u16 high_halves(u32 a, u32 b) {
  return detail::odd_halves((u16)a, (u16)b, std::make_index_sequence<2 * kLanes>{});
}

/// 16-bit lanes holding values below 256, narrowed to bytes.
inline u8 narrow(u16 x) {
  return __builtin_convertvector(x, u8);
}

/// A hint to fetch the cache line `bytes` past p for a coming read (kWrite 0) or write (1). A
/// prefetch never faults, and the address is formed as an integer, so asking past the end of an
/// array is no out-of-bounds pointer arithmetic.
template <int kWrite = 0, class P>
inline void prefetch(const P* p, int64_t bytes) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes), kWrite);
}

/// How many elements ahead of their use the streaming kernels prefetch: far enough to cover the
/// memory latency of several concurrent streams, which a hardware prefetcher may not keep ahead on
/// its own; the step time is flat around this distance (benchmarks/results/lowbit_cpu.md).
constexpr int64_t kPrefetchAhead = 1024;

/// prefetch() of the line holding p[kPrefetchAhead].
template <int kWrite = 0, class P>
inline void prefetch_ahead(const P* p) {
  prefetch<kWrite>(p, kPrefetchAhead * static_cast<int64_t>(sizeof(P)));
}

/// The lane-wise maximum.
inline u32 max(u32 a, u32 b) {
#if FASTAMP_SIMD_X86 && defined(__AVX512F__)
  return (u32)_mm512_maskz_max_epu32(kAll, (__m512i)a, (__m512i)b);
#elif FASTAMP_SIMD_X86 && defined(__AVX2__)
  return (u32)_mm256_max_epu32((__m256i)a, (__m256i)b);
#else
  return a > b ? a : b;
#endif
}

/// The largest lane.
inline uint32_t max_lane(u32 x) {
  uint32_t m = x[0];
  for (int i = 1; i < kLanes; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

}  // namespace simd
}  // namespace FASTAMP_CPU_NS
}  // namespace cpu
}  // namespace fastamp
