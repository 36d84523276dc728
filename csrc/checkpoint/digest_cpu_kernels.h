/// @file digest_cpu_kernels.h
/// The tensor digest's CPU word loop, built twice: for the baseline ISA and for AVX-512 (F, DQ),
/// where the compiler mixes 8 words per instruction (vpmullq); chosen at run time
/// (common/cpu_capability.h). Both sum the same terms, so both give the same bits.
#pragma once

#include <cstdint>

namespace fastamp {
namespace checkpoint {

/// Sum (mod 2^64) of digest_term over the whole 8-byte words [begin, end) of `p`.
uint64_t digest_words_default(const uint8_t* p, int64_t begin, int64_t end);
uint64_t digest_words_avx512(const uint8_t* p, int64_t begin, int64_t end);

}  // namespace checkpoint
}  // namespace fastamp
