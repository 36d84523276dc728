#include "common/cpu_capability.h"

#include <cstdlib>
#include <cstring>

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

}  // namespace fastamp
