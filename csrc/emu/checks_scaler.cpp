// The scaler ops' argument checks for the emulator library: scaler/ops.cpp compiled with its
// schema and kernel registrations compiled out (fastamp._C already registers them; the emulator
// registers its kernels under fastamp_emu, whose schemas the test harness copies from fastamp's).
// The checks are the very functions the GPU build links, not a copy.
#include "emu/no_registrations.h"

#include "scaler/ops.cpp"  // NOLINT(bugprone-suspicious-include)
