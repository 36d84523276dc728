// The digest's word loop built with AVX2: 4 words per instruction (one vpmuludq for their terms'
// products); used after a run-time check on CPUs without AVX-512 (e.g. AMD Zen 3).
#define FASTAMP_DIGEST_WORDS_FN digest_words_avx2
#include "checkpoint/digest_cpu_kernels.inc"
