// The scaler's CPU chunk kernels compiled with -mavx2 -mfma -mf16c (see CMakeLists.txt); only
// called after a runtime check that the CPU has those instructions.
#define FASTAMP_CPU_NS cap_avx2
#define FASTAMP_KERNELS_FN cpu_kernels_avx2
#include "scaler/scaler_cpu_kernels.inc"
