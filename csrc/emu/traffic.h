/// @file traffic.h
/// The CUDA emulator's global-memory traffic counters: what each kernel launch would ask of a
/// GPU's memory system, counted the way Nsight Compute counts it (requests per warp instruction,
/// 32-byte sectors per request).
///
/// How accesses are seen: the emulator compiles the kernel sources with GCC's ThreadSanitizer
/// instrumentation (tests/cuda_emu/build.py), which turns every load, store and atomic the
/// compiler emits into a call to __tsan_readN / __tsan_writeN / __tsan_atomicN_*(address).
/// traffic.cpp defines those hooks in place of TSan's runtime; they only record (and perform the
/// atomics). So no global access can bypass the count: there is no helper to forget to call.
/// (GCC's address-sanitizer hooks were the first choice, but ASan skips the check of a store to
/// an address a load of the same basic block checked: read-modify-write streams lost their
/// stores.) 16-byte vectors (gpu::vec_load / vec_store)
/// report themselves as one access (vector_access below), since the host compiler may split the
/// copy into four scalar loads that a GPU issues as one.
///
/// What counts as global memory: every address a thread of a kernel touches, except its own
/// stack (locals and its copy of the kernel parameters), the OS thread's stack (the launch's
/// parameter tuple), the emulator library's thread-local storage (where __shared__ variables
/// live) and its static data, and the emulator's per-thread bookkeeping (threadIdx and friends).
///
/// Grouping into requests: the lanes of a warp that execute the same instruction (the same
/// return address in the hook) for the same time form one request, as a converged warp issues
/// it. Per launch: requests, sectors summed over requests, the ideal sectors (the request's
/// distinct bytes over 32, rounded up), and the distinct sectors of the whole launch (its
/// footprint, the DRAM traffic with cold caches and no re-reads).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fastamp {
namespace emu {

/// The kernels' 16-byte vector accesses (gpu::vec_load / gpu::vec_store) since the last
/// reset_stats(); counted whether or not tracing is on.
struct VectorTraffic {
  int64_t loads = 0;
  int64_t stores = 0;
  int64_t load_bytes = 0;
  int64_t store_bytes = 0;
};
VectorTraffic vector_traffic();

/// One direction (loads or stores) of one launch.
struct AccessCounts {
  int64_t requests = 0;        // warp-level instructions
  int64_t bytes = 0;           // distinct bytes each request asked for, summed
  int64_t sectors = 0;         // 32-byte sectors each request touched, summed
  int64_t ideal_sectors = 0;   // ceil(request bytes / 32), summed: perfect coalescing
  int64_t unique_sectors = 0;  // distinct sectors over the whole launch
};

struct LaunchTraffic {
  std::string kernel;
  AccessCounts load;
  AccessCounts store;
};

/// Whether the kernels were compiled with the instrumentation (not in the --sanitize build).
bool traffic_instrumented();
void mark_instrumented();

/// Tracing on or off for later launches (off by default: it costs a hash-map update per access).
void set_traffic_trace(bool on);
/// The traced launches since the last reset_stats(), in launch order.
std::vector<LaunchTraffic> traffic();
void reset_traffic();
/// The distinct sectors (address / 32) the traced launches since the last reset_stats() loaded
/// (or stored), sorted: checked against the bytes a kernel read and changed, so an access the
/// instrumentation missed cannot go unnoticed.
std::vector<int64_t> footprint(bool store);

/// A vector access of `bytes` from `src` to `dst`, made without instrumentation and reported as
/// one access of `global` (= src for a load, dst for a store) from instruction `pc`.
void vector_access(void* dst, const void* src, size_t bytes, bool store, const void* pc);

// Called by the scheduler (runtime.cpp) around each launch and after each block.
void traffic_launch_begin(const char* kernel);
void traffic_block_end();
void traffic_launch_end();

/// The running CUDA thread, as the hooks need it (filled by runtime.cpp).
struct FiberView {
  unsigned tid = 0;                      // linear index in the block
  uintptr_t stack_lo = 0, stack_hi = 0;  // the fiber's stack
  uintptr_t book_lo = 0, book_hi = 0;    // the block's per-thread bookkeeping
};
/// False outside a kernel (host code of the launchers).
bool current_fiber(FiberView* out);

}  // namespace emu
}  // namespace fastamp
