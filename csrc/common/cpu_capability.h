/// @file cpu_capability.h
/// Which build of the CPU kernels to run: the AVX2+FMA+F16C one when the CPU has those
/// instructions, else the baseline. FASTAMP_CPU_CAPABILITY=default forces the baseline.
#pragma once

namespace fastamp {

/// Decided once per process.
bool cpu_use_avx2();

}  // namespace fastamp
