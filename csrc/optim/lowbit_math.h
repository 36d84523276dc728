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
///   computed from y truncated to bfloat16 (the high half of its bits), the mantissa rounded to
///   nearest even; smaller magnitudes decode to 0. The relative error is at most 2^-4 + 2^-8 in
///   each moment (about half that in sqrt(v), the update's denominator).
#pragma once

#include "common/macros.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

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

// The functions below are templates over the lane type so that the CPU kernels run the very same
// expressions on SIMD vectors (GCC vector extensions, common/cpu_simd.h) as the scalar reference
// and the CUDA kernel run on single values: `sel` and `splat` are the only helpers the two need.

/// mask ? a : b, lane-wise for vectors.
template <class M, class V>
FASTAMP_HOST_DEVICE inline V sel(M mask, V a, V b) {
  return mask ? a : b;
}

/// The lane type of V: V itself for a scalar, the element type of a vector.
template <class V, class = void>
struct lane_of {
  using type = V;
};
template <class V>
struct lane_of<V, std::enable_if_t<!std::is_arithmetic_v<V>>> {
  using type = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<V>()[0])>>;
};

/// The signed integer type of U's lanes (for an arithmetic shift): make_signed for a scalar, the
/// comparison result type (signed lanes of the same width) for a vector.
template <class U, class = void>
struct signed_of {
  using type = std::make_signed_t<U>;
};
template <class U>
struct signed_of<U, std::enable_if_t<!std::is_arithmetic_v<U>>> {
  using type = decltype(std::declval<U>() < std::declval<U>());
};

/// The constant c in every lane of V (or c itself for a scalar V).
template <class V, class S>
FASTAMP_HOST_DEVICE inline V splat(S c) {
  V r{};
  return r + static_cast<typename lane_of<V>::type>(c);
}

/// Lane-wise max / min (written as the plain conditional, which GCC turns into pmaxu / pminu for
/// vectors where a call of sel would stay a compare and a blend).
template <class V>
FASTAMP_HOST_DEVICE inline V lane_max(V a, V b) {
  return a < b ? b : a;
}

template <class V>
FASTAMP_HOST_DEVICE inline V lane_min(V a, V b) {
  return a < b ? a : b;
}

// --- 8-bit codes ---------------------------------------------------------------------------------

/// The code of y in [-1, 1] from `h`, the high 16 bits of y's float32 bits (y truncated to
/// bfloat16): sign | exponent (4 bits, bias 15) | mantissa (3 bits), the mantissa rounded to
/// nearest even. Below 2^-14 after rounding the exponent field is 0 (the code decodes to 0); past
/// the range (NaN, inf, |y| >= 2: a block scale makes |y| <= 1) the magnitude saturates at 127.
/// A NaN's code is 127 whatever its sign: which sign a NaN carries is the hardware's choice (x86's
/// default NaN is negative, an NVIDIA GPU's canonical NaN positive), so a signed code would make
/// the state differ between backends (its block scale is NaN: the code decodes to NaN either way).
/// Working on the high half keeps the CPU loop in 16-bit lanes, twice as many per instruction.
template <class H>
FASTAMP_HOST_DEVICE inline H m8_code(H h) {
  const H a = h & 0x7FFFu;
  const H t = (a + 7u + ((a >> 4) & 1u)) >> 4;      // float exponent << 3 | 3-bit mantissa, rounded
  const H lo = lane_max(t, splat<H>(896u)) - 896u;  // exponent field e + 15 (0 below 2^-14)
  const H mag = lane_min(lo, splat<H>(127u));
  return mag | sel(a > splat<H>(0x7F80u), splat<H>(0u), (h >> 8) & 0x80u);
}

/// The code of y in [0, 1] from the high half of its bits: exponent (5 bits, bias 31) | mantissa
/// (3 bits), rounded as m8_code; 0 exponent field below 2^-30, saturating at 255.
template <class H>
FASTAMP_HOST_DEVICE inline H v8_code(H h) {
  const H a = h & 0x7FFFu;
  const H t = (a + 7u + ((a >> 4) & 1u)) >> 4;
  const H lo = lane_max(t, splat<H>(768u)) - 768u;
  return lane_min(lo, splat<H>(255u));
}

/// The float32 bits of an exp_avg code (in a 32-bit lane): the code's exponent e + 15 becomes
/// float's e + 127 by setting the three bits above it; exponent field 0 decodes to 0. (The code
/// moved to the top and shifted back arithmetically lands exponent and mantissa in place with
/// the sign still on top: one shift pair and one mask-and-set.)
template <class U>
FASTAMP_HOST_DEVICE inline U m8_bits(U c) {
  using S = typename signed_of<U>::type;
  const U r = (U)((S)(c << 24) >> 4);
  const U b = (r & 0x87F00000u) | 0x38000000u;
  return sel((c & 0x78u) != 0u, b, splat<U>(0u));
}

/// The float32 bits of an exp_avg_sq code: exponent e + 31 -> e + 127; exponent field 0 -> 0.
template <class U>
FASTAMP_HOST_DEVICE inline U v8_bits(U c) {
  return sel(c >= 8u, (c << 20) | 0x30000000u, splat<U>(0u));  // c >= 8: exponent field != 0
}

FASTAMP_HOST_DEVICE inline uint8_t encode_m8(float y) {
  return static_cast<uint8_t>(m8_code<uint32_t>(float_bits(y) >> 16));
}

FASTAMP_HOST_DEVICE inline float decode_m8(uint8_t c) {
  return bits_float(m8_bits<uint32_t>(c));
}

FASTAMP_HOST_DEVICE inline uint8_t encode_v8(float y) {
  return static_cast<uint8_t>(v8_code<uint32_t>(float_bits(y) >> 16));
}

FASTAMP_HOST_DEVICE inline float decode_v8(uint8_t c) {
  return bits_float(v8_bits<uint32_t>(c));
}

/// 1 / absmax, or 0 for an all-zero block (whose codes are then all 0).
FASTAMP_HOST_DEVICE inline float block_reciprocal(float absmax) {
  return absmax > 0.0f ? 1.0f / absmax : 0.0f;
}

// --- stochastic rounding to bfloat16 ------------------------------------------------------------

/// A 32-bit integer hash with good avalanche (xorshift-multiply, "lowbias32").
template <class U>
FASTAMP_HOST_DEVICE inline U mix32(U x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/// The key of one tensor at one step (computed once per tensor, not per element).
FASTAMP_HOST_DEVICE inline uint32_t sr_key(uint32_t seed, uint32_t step, uint32_t position) {
  return mix32<uint32_t>(mix32<uint32_t>(seed ^ mix32<uint32_t>(step)) + position * 0x9E3779B9u);
}

/// The part of an element's counter that only its index's high 32 bits set (constant over a chunk
/// of the engine, whose start is a multiple of 2^16: a CPU loop then hashes 32-bit lanes only).
FASTAMP_HOST_DEVICE inline uint32_t sr_high(int64_t index) {
  return static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32) * 0x85EBCA6Bu;
}

/// mix32 without its first xorshift: enough for a counter XORed into an already mixed key. That
/// first step, x ^= x >> 16, would only XOR the same value into every element of a chunk (the
/// high half of key ^ counter is constant over one), so dropping it changes which bits each
/// element draws, not how random they are; it saves two vector instructions per element.
template <class U>
FASTAMP_HOST_DEVICE inline U mix32_tail(U x) {
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/// 32 random bits for the element whose index has low 32 bits `lo` and sr_high() `high`: one
/// multiply-xorshift round pair of the (already mixed) key combined with the counter (a
/// bijection of the counter with full avalanche, so distinct counters give independent-looking
/// bits).
template <class U>
FASTAMP_HOST_DEVICE inline U sr_bits32(uint32_t key, U lo, uint32_t high) {
  return mix32_tail<U>(lo ^ (key ^ high));
}

/// 32 random bits for element `index` of the tensor keyed `key`: the low 16 round exp_avg, the
/// high 16 exp_avg_sq.
FASTAMP_HOST_DEVICE inline uint32_t sr_bits(uint32_t key, int64_t index) {
  return sr_bits32<uint32_t>(key, static_cast<uint32_t>(static_cast<uint64_t>(index)),
                             sr_high(index));
}

/// x's float32 bits `b` plus 16 random bits `r` below the bfloat16 mantissa: the high half of the
/// sum is x rounded to bfloat16 up or down with probability proportional to the distance (the
/// carry does the rounding; inf stays inf, a finite value may round up to inf). A NaN becomes the
/// quiet NaN 0x7FC0: which NaN float arithmetic returns depends on operand order (x86 keeps the
/// first operand's, and compilers may swap the operands of an addition) and on the hardware (a
/// GPU returns its canonical NaN), so only a canonical one is the same on every backend.
template <class F, class U>
FASTAMP_HOST_DEVICE inline U bf16_sr_sum(F x, U b, U r) {
  return sel(x != x, splat<U>(0x7FC00000u), b) + (r & 0xFFFFu);
}

/// A block maximum (bits of |m| or v) with a NaN made the canonical 0x7FC00000, for the reason
/// above: the stored scale is then the same on every backend.
FASTAMP_HOST_DEVICE inline uint32_t canonical_max(uint32_t bits) {
  return bits > 0x7F800000u ? 0x7FC00000u : bits;
}

FASTAMP_HOST_DEVICE inline uint16_t bf16_stochastic(float x, uint32_t r) {
  return static_cast<uint16_t>(bf16_sr_sum<float, uint32_t>(x, float_bits(x), r) >> 16);
}

/// The larger of two non-negative floats (or zeros), as their bit patterns compare: an integer
/// max, which vectorises where a float max reduction would not (IEEE NaN rules).
template <class U>
FASTAMP_HOST_DEVICE inline U max_bits(U a, U b) {
  return lane_max(a, b);
}

FASTAMP_HOST_DEVICE inline float bf16_bits_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

}  // namespace FASTAMP_CPU_NS
}  // namespace optim
}  // namespace fastamp
