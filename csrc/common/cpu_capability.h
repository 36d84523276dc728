/// @file cpu_capability.h
/// Which build of the CPU kernels to run: the AVX2+FMA+F16C one when the CPU has those
/// instructions, else the baseline; the optimizers' kernels also have an AVX-512 (F, BW, VL, DQ)
/// build. FASTAMP_CPU_CAPABILITY=default forces the baseline, =avx2 caps the choice at AVX2 (as
/// ATEN_CPU_CAPABILITY does for PyTorch's kernels).
#pragma once

namespace fastamp {

/// Decided once per process.
bool cpu_use_avx2();

/// Decided once per process; implies cpu_use_avx2().
bool cpu_use_avx512();

}  // namespace fastamp
