/// @file cuda_shim.h
/// The CUDA language, as far as fastamp's kernels use it, for a host C++ compiler: the execution
/// space keywords, the built-in index variables, barriers, warp shuffles and atomics, all routed
/// to the emulator (runtime.h). Included (through common/gpu.cuh) instead of the CUDA headers when
/// a .cu file is compiled with FASTAMP_CUDA_EMULATOR; the kernel sources are not edited for it.
///
/// Anything a kernel uses that is not here fails to compile under the emulator, which is the
/// point: a new intrinsic gets an emulation (and a test) before a kernel may use it.
#pragma once

#if defined(__CUDACC__)
#error "cuda_shim.h is for host compilers emulating CUDA; nvcc has the real thing"
#endif

#include "emu/runtime.h"

#include <atomic>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One copy per OS thread, i.e. per running block (runtime.h). Not reset between blocks.
#define __shared__ static thread_local
#define __restrict__ __restrict

using dim3 = ::fastamp::emu::dim3;
using uint3 = ::fastamp::emu::uint3;

#define threadIdx (::fastamp::emu::ctx().thread_idx)
#define blockIdx (::fastamp::emu::ctx().block_idx)
#define blockDim (::fastamp::emu::ctx().block_dim)
#define gridDim (::fastamp::emu::ctx().grid_dim)

// Names with two leading underscores are reserved for the implementation; here we *are* the CUDA
// implementation, so the reserved spellings are the point.
inline void __syncthreads() {
  ::fastamp::emu::syncthreads();
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::fastamp::emu::warp_collective(::fastamp::emu::WarpOp::kSync, mask, 0, 0, 32);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  using namespace ::fastamp::emu;
  return from_bits<T>(warp_collective(WarpOp::kShflIdx, mask, to_bits(v), src_lane, width));
}

template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::fastamp::emu;
  return from_bits<T>(
      warp_collective(WarpOp::kShflUp, mask, to_bits(v), static_cast<int>(delta), width));
}

template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::fastamp::emu;
  return from_bits<T>(
      warp_collective(WarpOp::kShflDown, mask, to_bits(v), static_cast<int>(delta), width));
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  using namespace ::fastamp::emu;
  return from_bits<T>(warp_collective(WarpOp::kShflXor, mask, to_bits(v), lane_mask, width));
}

// Atomics: the threads of a block share an OS thread, but blocks may not, so these are real host
// atomics. They return the old value, as CUDA's do.
template <typename T>
T fastamp_emu_atomic_add(T* address, T val) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
  } else {
    T old;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    T desired;
    do {
      desired = old + val;
    } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
    return old;
  }
}

inline int atomicAdd(int* a, int v) {
  return fastamp_emu_atomic_add(a, v);
}
inline unsigned atomicAdd(unsigned* a, unsigned v) {
  return fastamp_emu_atomic_add(a, v);
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return fastamp_emu_atomic_add(a, v);
}
inline float atomicAdd(float* a, float v) {
  return fastamp_emu_atomic_add(a, v);
}
inline double atomicAdd(double* a, double v) {
  return fastamp_emu_atomic_add(a, v);
}
