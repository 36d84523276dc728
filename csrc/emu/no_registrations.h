/// @file no_registrations.h
/// Turns the TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL blocks of a following #include into
/// unused functions, so that a file holding both argument checks and registrations (ops.cpp) can
/// lend its checks to the emulator library without registering anything twice.
#pragma once

#include <torch/library.h>

#undef TORCH_LIBRARY_FRAGMENT
#undef TORCH_LIBRARY_IMPL
#define FASTAMP_EMU_CAT2(a, b) a##b
#define FASTAMP_EMU_CAT(a, b) FASTAMP_EMU_CAT2(a, b)
#define TORCH_LIBRARY_FRAGMENT(ns, m) \
  [[maybe_unused]] static void FASTAMP_EMU_CAT(fastamp_emu_unused_def_, __LINE__)(torch::Library & m)
#define TORCH_LIBRARY_IMPL(ns, k, m) \
  [[maybe_unused]] static void FASTAMP_EMU_CAT(fastamp_emu_unused_impl_, __LINE__)(torch::Library & m)
