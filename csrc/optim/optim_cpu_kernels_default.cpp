// The fused optimizers' CPU chunk kernels for the baseline instruction set.
#define FASTAMP_CPU_NS cap_default
#define FASTAMP_KERNELS_FN optim_cpu_kernels_default
#include "optim/optim_cpu_kernels.inc"
