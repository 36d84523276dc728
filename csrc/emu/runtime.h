/// @file runtime.h
/// The CUDA execution emulator: runs CUDA kernels, compiled by a host C++ compiler, on the CPU.
///
/// Why: no machine this project builds and tests on has a GPU. Without this, the CUDA kernels and
/// their host launchers would only ever be compiled. With it, CI runs them and compares them with
/// the CPU kernels (tests/cuda_emu).
///
/// Model (what a kernel observes):
/// - Every CUDA thread is a fiber (its own stack, a ucontext). The threads of one block run on one
///   OS thread, switching only at synchronisation points; blocks run one after another.
/// - Blocks, and the threads of a block, are started in an order set by set_order(): ascending,
///   descending, or seeded-random (re-drawn at every scheduling round). A kernel whose result
///   depends on that order has a missing barrier or an order-dependent reduction.
/// - __syncthreads() releases when every thread of the block has arrived. A thread that exits
///   while others wait, or a barrier reached after a thread exited, is an error; so is a deadlock.
/// - Warp collectives (__shfl*_sync, __syncwarp) wait until every lane named in the mask has
///   reached a collective; they must all be the same collective with the same mask and width.
///   A lane outside its own mask, a lane of the mask that has exited or waits at a barrier, and
///   a shuffle that reads a lane outside the mask, are errors.
/// - __shared__ variables are thread_local statics: one copy per OS thread, i.e. per running block.
/// - Atomics are host atomics. 16-byte vector loads and stores through fastamp::gpu::vec_load /
///   vec_store check their alignment; so does every scalar global access of the instrumented
///   kernel sources (traffic.h).
/// - Global-memory requests and sectors are counted per launch when tracing is on (traffic.h).
/// - Launches are refused where CUDA refuses them: an empty grid, more than 1024 threads per block
///   or a block dimension over its limit, kernel parameters over 4096 bytes.
/// Not modelled (docs/reliability.md): memory ordering between sync points (each block runs alone,
/// so inter-block races on plain stores are invisible), device libm rounding, warp lockstep
/// execution, __launch_bounds__ register limits, tensors over 2^31 elements (too slow here).
///
/// Errors are collected inside the fiber (a fiber cannot unwind into the scheduler) and raised by
/// launch() on the host as a c10::Error naming the kernel, the block and the thread.
#pragma once

#include <c10/util/Exception.h>

#include "emu/traffic.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fastamp {
namespace emu {

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

/// What a running CUDA thread sees as threadIdx / blockIdx / blockDim / gridDim.
struct ThreadCtx {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

/// The context of the fiber running on this OS thread (null outside a kernel).
extern thread_local const ThreadCtx* tl_ctx;

[[noreturn]] void fail_outside_kernel();

inline const ThreadCtx& ctx() {
  if (tl_ctx == nullptr) fail_outside_kernel();
  return *tl_ctx;
}

// --- scheduling --------------------------------------------------------------------------------

enum class Order : int { kAscending = 0, kDescending = 1, kRandom = 2 };

/// Sets the order blocks and threads start in, for every later launch (process-wide).
void set_order(Order order, uint64_t seed);
Order order();

/// Counters since the last reset, for tests (e.g. "this op launched 3 kernels").
struct Stats {
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t threads = 0;
  int64_t switches = 0;
};
Stats stats();
void reset_stats();

/// Names of the kernels launched since the library was loaded, sorted.
std::vector<std::string> launched_kernels();

// --- device-side primitives (called from kernel code through the CUDA shim) --------------------

/// Records an error for the current thread and abandons it; the launch raises it on the host.
[[noreturn]] void device_error(const std::string& what);

void syncthreads();

enum class WarpOp : int { kSync = 0, kShflIdx, kShflUp, kShflDown, kShflXor };

/// One warp collective: waits for every lane of `mask`, then returns the 8-byte value this lane
/// receives (for kSync, 0). `value` is this lane's contribution, `arg` the lane/delta/xor operand.
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width);

/// Checks a vector access of `bytes` bytes at p is aligned as CUDA requires.
inline void check_aligned(const void* p, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    device_error(std::string("misaligned ") + std::to_string(bytes) + "-byte " + what +
                 " at address " + std::to_string(reinterpret_cast<uintptr_t>(p)) +
                 " (CUDA faults with 'misaligned address')");
  }
}

// --- launch --------------------------------------------------------------------------------------

/// Bytes of a kernel's parameter space, laid out as CUDA does (each parameter at its alignment).
template <typename... P>
constexpr size_t param_bytes() {
  size_t off = 0;
  ((off = (off + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
  return off;
}

constexpr size_t kMaxParamBytes = 4096;

/// Runs `body` once per thread of every block of the grid, as described at the top of this file.
/// Throws c10::Error on a refused launch or on any error a thread reported.
void run_grid(const char* kernel, dim3 grid, dim3 block, size_t param_size,
              const std::function<void()>& body);

/// launch(kernel, grid, block, args...): the emulator's `kernel<<<grid, block>>>(args...)`.
/// Arguments are converted to the parameter types once, as the CUDA runtime copies them to the
/// parameter space once; every thread then gets its own by-value copy of them.
template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "launch: wrong number of kernel arguments");
  static_assert((std::is_trivially_copyable_v<std::decay_t<P>> && ...),
                "kernel parameters must be trivially copyable");
  const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  run_grid(name, grid, block, param_bytes<std::decay_t<P>...>(),
           [&]() { std::apply(kernel, params); });
}

/// Bit-casts a trivially copyable value of up to 8 bytes to and from the collective's payload.
template <typename T>
uint64_t to_bits(const T& v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                "shuffle of a type over 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}

template <typename T>
T from_bits(uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

}  // namespace emu
}  // namespace fastamp
