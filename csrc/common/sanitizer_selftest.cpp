// Compiled only into sanitized builds (CMake -DFASTAMP_SANITIZE=...): an op whose sole purpose is
// to do something undefined on purpose, so the sanitizer harness (tests/sanitize/run.sh) can prove
// that a report really fails a run before it trusts "zero reports" from the op suite. A normal
// build has no such op.
#include "common/torch_api.h"

#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

namespace fastamp {
namespace {

// Opaque to the optimiser: stops -O1 from folding the bad access or the overflow away.
template <typename T>
T launder(T v) {
  asm volatile("" : "+r"(v));
  return v;
}

/// fastamp::_sanitizer_selftest(str kind) -> ()
/// kind "address": reads one int past the end of a heap array (ASan: heap-buffer-overflow).
/// kind "undefined": overflows a signed int (UBSan: signed-integer-overflow).
/// kind "misaligned": loads an int64 from an odd address (UBSan: misaligned address).
/// kind "none": does nothing (checks the op itself is reachable without a report).
void sanitizer_selftest(std::string kind) {
  if (kind == "none") return;
  if (kind == "address") {
    std::unique_ptr<int[]> a(new int[4]{1, 2, 3, 4});
    const int i = launder(4);
    volatile int sink = a[i];  // one past the end
    (void)sink;
    return;
  }
  if (kind == "undefined") {
    const int big = launder(INT_MAX);
    volatile int sink = big + launder(1);  // signed overflow
    (void)sink;
    return;
  }
  if (kind == "misaligned") {
    alignas(8) unsigned char buf[16] = {};
    const auto* p = reinterpret_cast<const int64_t*>(buf + launder(1));
    volatile int64_t sink = *p;  // 1-byte-aligned int64 load
    (void)sink;
    return;
  }
  FASTAMP_CHECK_VALUE(false,
                      "fastamp::_sanitizer_selftest: kind must be 'none', 'address', "
                      "'undefined' or 'misaligned'; got '",
                      kind, "'");
}

}  // namespace
}  // namespace fastamp

STABLE_TORCH_LIBRARY_FRAGMENT(fastamp, m) {
  m.def("_sanitizer_selftest(str kind) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(fastamp, CompositeExplicitAutograd, m) {
  m.impl("_sanitizer_selftest", TORCH_BOX(&fastamp::sanitizer_selftest));
}
