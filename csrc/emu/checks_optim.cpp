// The optimizer ops' argument checks for the emulator library (see checks_scaler.cpp).
#include "emu/no_registrations.h"

#include "optim/ops.cpp"  // NOLINT(bugprone-suspicious-include)
