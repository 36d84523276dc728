// The scaler's CPU chunk kernels for the baseline instruction set of the target.
#define FASTAMP_CPU_NS cap_default
#define FASTAMP_KERNELS_FN cpu_kernels_default
#include "scaler/scaler_cpu_kernels.inc"
