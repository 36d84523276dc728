// The fused optimizers' CPU chunk kernels built with AVX-512 (F, BW, VL, DQ) besides AVX2+FMA+F16C;
// used after a run-time check. The SIMD kernels (common/cpu_simd.h) take 16 float lanes here.
#define FASTAMP_CPU_NS cap_avx512
#define FASTAMP_KERNELS_FN optim_cpu_kernels_avx512
#include "optim/optim_cpu_kernels.inc"
