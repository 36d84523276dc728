/// @file digest_cpu_kernels.h
/// The tensor digest's CPU word loop, built three times: for the baseline ISA (SSE2 on x86: 2
/// words per instruction), for AVX2 (4) and for AVX-512 (8); chosen at run time
/// (common/cpu_capability.h). All sum the same terms, so all give the same bits.
#pragma once

#include <cstdint>

namespace fastamp {
namespace checkpoint {

/// Sum (mod 2^64) of digest_term over the whole 8-byte words [begin, end) of `p`.
uint64_t digest_words_default(const uint8_t* p, int64_t begin, int64_t end);
uint64_t digest_words_avx2(const uint8_t* p, int64_t begin, int64_t end);
uint64_t digest_words_avx512(const uint8_t* p, int64_t begin, int64_t end);

}  // namespace checkpoint
}  // namespace fastamp
