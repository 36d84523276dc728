/// @file digest_math.h
/// The tensor digest, shared by the CPU and CUDA kernels: a sum (mod 2^64) of a 64-bit mix of each
/// 8-byte word with its position. Addition commutes, so any summation order -- threads, blocks,
/// atomics -- gives the same bits; the position term makes moved or swapped words count.
#pragma once

#include "common/macros.h"

#include <cstdint>

namespace fastamp {
namespace checkpoint {

/// splitmix64's finaliser: a bijective mix with good avalanche.
FASTAMP_HOST_DEVICE inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/// What the position of a word adds to it before the mix, per word (the golden ratio in 64 bits).
constexpr uint64_t kDigestStep = 0x9e3779b97f4a7c15ULL;

/// Contribution of word `i` (the bytes [8i, 8i+8), zero-padded at the end) to the digest.
FASTAMP_HOST_DEVICE inline uint64_t digest_term(uint64_t word, uint64_t i) {
  return mix64(word + (i + 1) * kDigestStep);
}

/// Final digest of a tensor of `nbytes` bytes whose terms sum to `sum`.
FASTAMP_HOST_DEVICE inline uint64_t digest_finish(uint64_t sum, uint64_t nbytes) {
  return mix64(sum ^ mix64(nbytes));
}

}  // namespace checkpoint
}  // namespace fastamp
