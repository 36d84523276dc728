// The digest's word loop for the baseline ISA.
#define FASTAMP_DIGEST_WORDS_FN digest_words_default
#include "checkpoint/digest_cpu_kernels.inc"
