// The digest's word loop built with AVX2: the compiler mixes 4 words per instruction, each 64-bit
// multiply made of three 32-bit ones (vpmuludq; AVX2 has no 64-bit multiply); used after a
// run-time check on CPUs without AVX-512 (e.g. AMD Zen 3).
#define FASTAMP_DIGEST_WORDS_FN digest_words_avx2
#include "checkpoint/digest_cpu_kernels.inc"
