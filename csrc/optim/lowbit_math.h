/// @file lowbit_math.h
/// Element math of the low-precision optimizer state (fastamp.optim.Adam/AdamW with
/// state_dtype=torch.bfloat16 or "int8"), shared by the CPU and CUDA kernels.
///
/// * bfloat16 moments are stored with stochastic rounding: 16 random bits are added below the
///   bfloat16 mantissa before truncating, so E[stored] = value. The bits come from a counter-based
///   hash of (seed, step, list position, element index): reproducible, the same on every backend
///   and thread count.
/// * 8-bit moments are quantized in blocks of 256 elements against the block's absolute maximum
///   (stored as float32 beside the codes). The codes are small floating-point formats computed by
///   bit arithmetic (no table search, so encode and decode vectorise):
///     exp_avg:    sign, 4-bit exponent, 3-bit mantissa of m / absmax(m)  (|y| in [2^-14, 1])
///     exp_avg_sq: 5-bit exponent, 3-bit mantissa of v / max(v)          (y in [2^-30, 1])
///   rounded to nearest even; smaller magnitudes flush to 0. The relative rounding error is at
///   most 2^-4 in each moment (2^-5 in sqrt(v), the update's denominator).
#pragma once

#include "common/macros.h"

#include <cstdint>
#include <cstring>

#ifndef FASTAMP_CPU_NS
#define FASTAMP_CPU_NS cap_default
#endif

namespace fastamp {
namespace optim {

/// Elements per 8-bit quantization block (one float32 scale each). kChunkElems is a multiple, so a
/// block never straddles two chunks of the multi-tensor engine.
constexpr int kQuantBlock = 256;

inline namespace FASTAMP_CPU_NS {

FASTAMP_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

FASTAMP_HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// --- 8-bit codes ---------------------------------------------------------------------------------

/// The code of y in [-1, 1]: sign | exponent (4 bits, bias 15) | mantissa (3 bits).
FASTAMP_HOST_DEVICE inline uint8_t encode_m8(float y) {
  uint32_t b = float_bits(y);
  const uint32_t sign = (b >> 24) & 0x80u;
  b &= 0x7FFFFFFFu;
  b += 0x7FFFFu + ((b >> 20) & 1u);  // round the mantissa to 3 bits, to nearest even
  const int e = static_cast<int>(b >> 23) - 127;
  const uint32_t code = sign | (static_cast<uint32_t>(e + 15) << 3) | ((b >> 20) & 7u);
  // zero, and magnitudes below 2^-14 after rounding -> 0; NaN/inf or past 1 -> the code of 1.0
  return static_cast<uint8_t>(e < -14 ? 0u : (e > 0 ? (sign | 0x78u) : code));
}

FASTAMP_HOST_DEVICE inline float decode_m8(uint8_t c) {
  const uint32_t ex = (c >> 3) & 0xFu;
  const uint32_t b = ((static_cast<uint32_t>(c) & 0x80u) << 24) | ((ex + 112u) << 23) |
                     ((static_cast<uint32_t>(c) & 7u) << 20);
  return ex == 0 ? 0.0f : bits_float(b);  // exponent field e + 15 -> float's e + 127
}

/// The code of y in [0, 1]: exponent (5 bits, bias 31) | mantissa (3 bits).
FASTAMP_HOST_DEVICE inline uint8_t encode_v8(float y) {
  uint32_t b = float_bits(y) & 0x7FFFFFFFu;
  b += 0x7FFFFu + ((b >> 20) & 1u);
  const int e = static_cast<int>(b >> 23) - 127;
  const uint32_t code = (static_cast<uint32_t>(e + 31) << 3) | ((b >> 20) & 7u);
  return static_cast<uint8_t>(e < -30 ? 0u : (e > 0 ? 0xF8u : code));  // 0xF8: the code of 1.0
}

FASTAMP_HOST_DEVICE inline float decode_v8(uint8_t c) {
  const uint32_t ex = static_cast<uint32_t>(c) >> 3;
  const uint32_t b = ((ex + 96u) << 23) | ((static_cast<uint32_t>(c) & 7u) << 20);
  return ex == 0 ? 0.0f : bits_float(b);  // exponent field e + 31 -> float's e + 127
}

/// 1 / absmax, or 0 for an all-zero block (whose codes are then all 0).
FASTAMP_HOST_DEVICE inline float block_reciprocal(float absmax) {
  return absmax > 0.0f ? 1.0f / absmax : 0.0f;
}

// --- stochastic rounding to bfloat16 ------------------------------------------------------------

/// A 32-bit integer hash with good avalanche (xorshift-multiply, "lowbias32").
FASTAMP_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/// The key of one tensor at one step (computed once per tensor, not per element).
FASTAMP_HOST_DEVICE inline uint32_t sr_key(uint32_t seed, uint32_t step, uint32_t position) {
  return mix32(mix32(seed ^ mix32(step)) + position * 0x9E3779B9u);
}

/// The part of an element's counter that only its index's high 32 bits set (constant over a chunk
/// of the engine, whose start is a multiple of 2^16: a CPU loop then hashes 32-bit lanes only).
FASTAMP_HOST_DEVICE inline uint32_t sr_high(int64_t index) {
  return static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32) * 0x85EBCA6Bu;
}

/// 32 random bits for the element whose index has low 32 bits `lo` and sr_high() `high`: one
/// hash of the (already mixed) key combined with the counter (mix32 is a bijection with full
/// avalanche, so distinct counters give independent-looking bits; one round keeps the CPU loop
/// cheap).
FASTAMP_HOST_DEVICE inline uint32_t sr_bits32(uint32_t key, uint32_t lo, uint32_t high) {
  return mix32(key ^ lo ^ high);
}

/// 32 random bits for element `index` of the tensor keyed `key`: the low 16 round exp_avg, the
/// high 16 exp_avg_sq.
FASTAMP_HOST_DEVICE inline uint32_t sr_bits(uint32_t key, int64_t index) {
  return sr_bits32(key, static_cast<uint32_t>(static_cast<uint64_t>(index)), sr_high(index));
}

/// x rounded to bfloat16 (its bits) up or down with probability proportional to the distance:
/// r (16 random bits) is added below the kept mantissa, then the low half is dropped. inf and NaN
/// are truncated (a NaN stays a NaN).
FASTAMP_HOST_DEVICE inline uint16_t bf16_stochastic(float x, uint32_t r) {
  const uint32_t b = float_bits(x);
  // Selects, not branches: the CPU loop vectorises.
  const uint32_t kept = (b >> 16) | ((b & 0xFFFFu) != 0 ? 0x40u : 0u);
  const uint32_t rounded = (b + (r & 0xFFFFu)) >> 16;
  return static_cast<uint16_t>((b & 0x7F800000u) == 0x7F800000u ? kept : rounded);
}

/// The larger of two non-negative floats (or zeros), as their bit patterns compare: an integer
/// max, which vectorises where a float max reduction would not (IEEE NaN rules).
FASTAMP_HOST_DEVICE inline uint32_t max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }

FASTAMP_HOST_DEVICE inline float bf16_bits_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

}  // namespace FASTAMP_CPU_NS
}  // namespace optim
}  // namespace fastamp
