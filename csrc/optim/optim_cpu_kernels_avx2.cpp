// The fused optimizers' CPU chunk kernels built with -mavx2 -mfma -mf16c; used after a run-time
// check.
#define FASTAMP_CPU_NS cap_avx2
#define FASTAMP_KERNELS_FN optim_cpu_kernels_avx2
#include "optim/optim_cpu_kernels.inc"
