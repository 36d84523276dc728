/// @file digest_math.h
/// The tensor digest, shared by the CPU and CUDA kernels: a sum (mod 2^64) of one term per 8-byte
/// word, the word keyed by its position, finished with a 64-bit mix of the sum and the byte count.
/// Addition commutes, so any summation order -- threads, blocks, atomics -- gives the same bits;
/// the position key makes moved or swapped words count.
///
/// A term is the 32 x 32 -> 64-bit product of the keyed word's halves plus the keyed word with
/// its halves swapped (the accumulation step of xxHash's XXH3): one 32-bit multiply per word,
/// which AVX2 (vpmuludq, 4 words an instruction) and AVX-512 (8) make at memory speed, where the
/// splitmix64 mix of every word it replaced took two 64-bit multiplies (three 32-bit ones each
/// without AVX-512). Any one changed bit changes the sum (the swapped word moves by 2^k, the
/// product by a multiple of a 32-bit half, and the two cannot cancel); a random change of several
/// words leaves it equal with a probability of about 2^-64.
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

/// The key of word i is (i + 1) * kDigestStep (the golden ratio in 64 bits), made by the CPU loop
/// as a running sum.
constexpr uint64_t kDigestStep = 0x9e3779b97f4a7c15ULL;

/// The term of a word already keyed by its position (`word ^ key`).
FASTAMP_HOST_DEVICE inline uint64_t digest_keyed_term(uint64_t x) {
  const uint64_t swapped = (x << 32) | (x >> 32);
  return static_cast<uint64_t>(static_cast<uint32_t>(x)) * static_cast<uint32_t>(x >> 32) + swapped;
}

/// Contribution of word `i` (the bytes [8i, 8i+8), zero-padded at the end) to the digest.
FASTAMP_HOST_DEVICE inline uint64_t digest_term(uint64_t word, uint64_t i) {
  return digest_keyed_term(word ^ ((i + 1) * kDigestStep));
}

/// Final digest of a tensor of `nbytes` bytes whose terms sum to `sum`.
FASTAMP_HOST_DEVICE inline uint64_t digest_finish(uint64_t sum, uint64_t nbytes) {
  return mix64(sum ^ mix64(nbytes));
}

}  // namespace checkpoint
}  // namespace fastamp
