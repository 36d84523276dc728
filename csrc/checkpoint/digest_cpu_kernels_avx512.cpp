// The digest's word loop built with AVX-512: 8 words per instruction (one vpmuludq for their
// terms' products); used after a run-time check.
#define FASTAMP_DIGEST_WORDS_FN digest_words_avx512
#include "checkpoint/digest_cpu_kernels.inc"
