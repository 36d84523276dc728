// Which SIMD flavour of the CPU kernels this machine runs (decided once, at load), and the op
// that reports it.
#include "common/cpu_capability.h"

#include "common/torch_api.h"

#include <cstdlib>
#include <cstring>
#include <string>

namespace fastamp {

bool cpu_use_avx2() {
  static const bool use = [] {
    const char* force = std::getenv("FASTAMP_CPU_CAPABILITY");
    if (force != nullptr && std::strcmp(force, "default") == 0) return false;
#if defined(__x86_64__) || defined(_M_X64)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
  }();
  return use;
}

bool cpu_use_avx512() {
  static const bool use = [] {
    if (!cpu_use_avx2()) return false;
    const char* force = std::getenv("FASTAMP_CPU_CAPABILITY");
    if (force != nullptr && std::strcmp(force, "avx2") == 0) return false;
#if defined(__x86_64__) || defined(_M_X64)
    // libgcc's checks include the OS saving the AVX-512 registers (XCR0).
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
    return false;
#endif
  }();
  return use;
}

}  // namespace fastamp

namespace {

// The newest instruction set a CPU kernel of this process runs with (the optimizers' kernels have
// an AVX-512 build; the others stop at AVX2). For build_info() and the capability tests.
std::string cpu_capability_name() {
  if (fastamp::cpu_use_avx512()) return "avx512";
  return fastamp::cpu_use_avx2() ? "avx2" : "default";
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  m.def("_cpu_capability() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("_cpu_capability", TORCH_BOX(&cpu_capability_name));
}
