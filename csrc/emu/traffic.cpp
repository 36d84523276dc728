// The CUDA emulator's global-memory traffic counters (see traffic.h for the model). This file is
// compiled without instrumentation; the kernel sources are compiled with it and call the
// __tsan_* hooks defined at the bottom.
#include "emu/traffic.h"

#include "emu/runtime.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace fastamp {
namespace emu {
namespace {

constexpr int kWarp = 32;
constexpr uintptr_t kSector = 32;

std::atomic<bool> g_trace{false};
std::atomic<bool> g_instrumented{false};  // set by the instrumented units' constructors
std::atomic<int64_t> g_vec_loads{0};
std::atomic<int64_t> g_vec_stores{0};
std::atomic<int64_t> g_vec_load_bytes{0};
std::atomic<int64_t> g_vec_store_bytes{0};
std::mutex g_mu;
std::vector<LaunchTraffic> g_launches;
std::unordered_set<uintptr_t> g_footprint[2];  // sectors loaded, stored by the traced launches

struct Range {
  uintptr_t lo = 0, hi = 0;
  bool has(uintptr_t a) const { return a >= lo && a < hi; }
};

/// Address ranges that are never global memory, per OS thread: its stack, this library's
/// thread-local block (the __shared__ variables) and this library's loaded segments (static data).
struct NotGlobal {
  bool ready = false;
  Range stack, tls;
  std::vector<Range> segments;
  bool has(uintptr_t a) const {
    if (stack.has(a) || tls.has(a)) return true;
    for (const Range& r : segments) {
      if (r.has(a)) return true;
    }
    return false;
  }
};

int find_self(dl_phdr_info* info, size_t /*size*/, void* data) {
  auto* out = static_cast<NotGlobal*>(data);
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&find_self), &self) == 0) return 0;
  if (reinterpret_cast<uintptr_t>(self.dli_fbase) != info->dlpi_addr) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr) & ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD) {
      const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
      out->segments.push_back({lo, lo + ph.p_memsz});
    } else if (ph.p_type == PT_TLS && info->dlpi_tls_data != nullptr) {
      const auto lo = reinterpret_cast<uintptr_t>(info->dlpi_tls_data);
      out->tls = {lo, lo + ph.p_memsz};
    }
  }
  return 1;
}

const NotGlobal& not_global() {
  thread_local NotGlobal ng;
  if (!ng.ready) {
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* addr = nullptr;
      size_t size = 0;
      pthread_attr_getstack(&attr, &addr, &size);
      ng.stack = {reinterpret_cast<uintptr_t>(addr), reinterpret_cast<uintptr_t>(addr) + size};
      pthread_attr_destroy(&attr);
    }
    dl_iterate_phdr(&find_self, &ng);
    ng.ready = true;
  }
  return ng;
}

struct RequestKey {
  uintptr_t pc;
  uint32_t warp;
  uint32_t occurrence;
  bool store;
  bool operator==(const RequestKey& o) const {
    return pc == o.pc && warp == o.warp && occurrence == o.occurrence && store == o.store;
  }
};

struct RequestHash {
  size_t operator()(const RequestKey& k) const {
    uint64_t h = k.pc * 0x9e3779b97f4a7c15ull;
    h ^= (uint64_t{k.warp} << 32 | k.occurrence) + 0x632be59bd9b4e019ull + (h << 6) + (h >> 2);
    return static_cast<size_t>(h ^ (k.store ? 0x85ebca6bull : 0));
  }
};

/// The accesses of the block being run, grouped into requests, and the launch's running totals.
struct Trace {
  bool active = false;
  LaunchTraffic launch;
  std::unordered_set<uintptr_t> sectors[2];            // loads, stores
  std::unordered_map<uint64_t, uint32_t> occurrences;  // (pc, tid) -> times executed
  std::unordered_map<RequestKey, std::vector<std::pair<uintptr_t, uint32_t>>, RequestHash> requests;
};

thread_local Trace tl_trace;

void record(uintptr_t addr, size_t size, bool store, uintptr_t pc) {
  if (!g_trace.load(std::memory_order_relaxed)) return;  // the common case: one load
  Trace& t = tl_trace;
  if (!t.active || size == 0) return;
  FiberView f;
  if (!current_fiber(&f)) return;  // host code
  if ((addr >= f.stack_lo && addr < f.stack_hi) || (addr >= f.book_lo && addr < f.book_hi)) {
    return;
  }
  if (not_global().has(addr)) return;
  uint32_t& occ = t.occurrences[(uint64_t{pc} << 10) ^ f.tid];
  t.requests[RequestKey{pc, f.tid / kWarp, occ++, store}].emplace_back(addr,
                                                                       static_cast<uint32_t>(size));
}

/// Reports a misaligned access of `n` (a power of 2) bytes at `addr` if a kernel made it to
/// global memory.
[[gnu::noinline, gnu::cold]] void misaligned(uintptr_t addr, size_t n, bool store) {
  FiberView f;
  if (!current_fiber(&f)) return;  // host code
  if ((addr >= f.stack_lo && addr < f.stack_hi) || (addr >= f.book_lo && addr < f.book_hi)) {
    return;
  }
  if (not_global().has(addr)) return;
  device_error("misaligned " + std::to_string(n) + "-byte " + (store ? "store" : "load") +
               " at address " + std::to_string(addr) + " (CUDA faults with 'misaligned address')");
}

}  // namespace

void mark_instrumented() {
  g_instrumented.store(true);
}

bool traffic_instrumented() {
  return g_instrumented.load();
}

void set_traffic_trace(bool on) {
  g_trace.store(on);
}

std::vector<LaunchTraffic> traffic() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_launches;
}

void reset_traffic() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_launches.clear();
  g_footprint[0].clear();
  g_footprint[1].clear();
  g_vec_loads = 0;
  g_vec_stores = 0;
  g_vec_load_bytes = 0;
  g_vec_store_bytes = 0;
}

std::vector<int64_t> footprint(bool store) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<int64_t> out(g_footprint[store ? 1 : 0].begin(), g_footprint[store ? 1 : 0].end());
  std::sort(out.begin(), out.end());
  return out;
}

VectorTraffic vector_traffic() {
  return {g_vec_loads.load(), g_vec_stores.load(), g_vec_load_bytes.load(),
          g_vec_store_bytes.load()};
}

void vector_access(void* dst, const void* src, size_t bytes, bool store, const void* pc) {
  (store ? g_vec_stores : g_vec_loads).fetch_add(1, std::memory_order_relaxed);
  (store ? g_vec_store_bytes : g_vec_load_bytes)
      .fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  record(reinterpret_cast<uintptr_t>(store ? dst : src), bytes, store,
         reinterpret_cast<uintptr_t>(pc));
  std::memcpy(dst, src, bytes);
}

void traffic_launch_begin(const char* kernel) {
  Trace& t = tl_trace;
  t.active = g_trace.load();
  if (!t.active) return;
  t.launch = LaunchTraffic{};
  t.launch.kernel = kernel;
  t.sectors[0].clear();
  t.sectors[1].clear();
}

void traffic_block_end() {
  Trace& t = tl_trace;
  if (!t.active) return;
  std::vector<uintptr_t> secs;
  for (auto& [key, parts] : t.requests) {
    AccessCounts& c = key.store ? t.launch.store : t.launch.load;
    std::sort(parts.begin(), parts.end());
    int64_t distinct = 0;
    uintptr_t covered = 0;  // bytes below this address are counted already
    secs.clear();
    for (const auto& [a, n] : parts) {
      const uintptr_t end = a + n;
      if (end > covered) distinct += static_cast<int64_t>(end - std::max(a, covered));
      covered = std::max(covered, end);
      for (uintptr_t s = a / kSector; s <= (end - 1) / kSector; ++s) secs.push_back(s);
    }
    std::sort(secs.begin(), secs.end());
    secs.erase(std::unique(secs.begin(), secs.end()), secs.end());
    c.requests += 1;
    c.bytes += distinct;
    c.sectors += static_cast<int64_t>(secs.size());
    c.ideal_sectors += (distinct + static_cast<int64_t>(kSector) - 1) / kSector;
    t.sectors[key.store ? 1 : 0].insert(secs.begin(), secs.end());
  }
  t.requests.clear();
  t.occurrences.clear();
}

void traffic_launch_end() {
  Trace& t = tl_trace;
  if (!t.active) return;
  t.active = false;
  t.launch.load.unique_sectors = static_cast<int64_t>(t.sectors[0].size());
  t.launch.store.unique_sectors = static_cast<int64_t>(t.sectors[1].size());
  std::lock_guard<std::mutex> lock(g_mu);
  g_launches.push_back(std::move(t.launch));
  for (int d = 0; d < 2; ++d) g_footprint[d].insert(t.sectors[d].begin(), t.sectors[d].end());
}

}  // namespace emu
}  // namespace fastamp

// The hooks GCC's ThreadSanitizer instrumentation calls at each load, store and atomic of the
// kernel sources (their signatures are the TSan runtime's, which is not linked: these record the
// access and, for atomics, perform it, sequentially consistent whatever order was asked). Hidden:
// they serve this library only.
namespace fastamp {
namespace emu {
namespace {
inline void hook(const volatile void* a, size_t n, bool store, void* pc) {
  const auto addr = reinterpret_cast<uintptr_t>(a);
  // A GPU faults on a global access not aligned to its size ("misaligned address"); x86 does
  // not, so without this check a misaligned scalar access would pass every emulated test.
  if ((addr & (n - 1)) != 0) misaligned(addr, n, store);
  record(addr, n, store, reinterpret_cast<uintptr_t>(pc));
}
/// A block of bytes (a struct copy): no alignment of its own.
inline void hook_range(const volatile void* a, size_t n, bool store, void* pc) {
  record(reinterpret_cast<uintptr_t>(a), n, store, reinterpret_cast<uintptr_t>(pc));
}
}  // namespace
}  // namespace emu
}  // namespace fastamp

#define FASTAMP_EMU_HIDDEN extern "C" __attribute__((visibility("hidden")))
#define FASTAMP_EMU_ACCESS(n)                                     \
  FASTAMP_EMU_HIDDEN void __tsan_read##n(void* a) {               \
    fastamp::emu::hook(a, n, false, __builtin_return_address(0)); \
  }                                                               \
  FASTAMP_EMU_HIDDEN void __tsan_write##n(void* a) {              \
    fastamp::emu::hook(a, n, true, __builtin_return_address(0));  \
  }
FASTAMP_EMU_ACCESS(1)
FASTAMP_EMU_ACCESS(2)
FASTAMP_EMU_ACCESS(4)
FASTAMP_EMU_ACCESS(8)
FASTAMP_EMU_ACCESS(16)

FASTAMP_EMU_HIDDEN void __tsan_read_range(void* a, unsigned long n) {
  fastamp::emu::hook_range(a, n, false, __builtin_return_address(0));
}
FASTAMP_EMU_HIDDEN void __tsan_write_range(void* a, unsigned long n) {
  fastamp::emu::hook_range(a, n, true, __builtin_return_address(0));
}
FASTAMP_EMU_HIDDEN void __tsan_vptr_update(void** /*vptr*/, void* /*value*/) {}
// Called by each instrumented translation unit's constructor when the library loads.
FASTAMP_EMU_HIDDEN void __tsan_init() {
  fastamp::emu::mark_instrumented();
}

// An atomic is one read-modify-write request of its size (counted as a store).
#define FASTAMP_EMU_ATOMIC(bits, T)                                                                \
  FASTAMP_EMU_HIDDEN T __tsan_atomic##bits##_load(const volatile T* a, int /*mo*/) {               \
    fastamp::emu::hook(a, sizeof(T), false, __builtin_return_address(0));                          \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                   \
  }                                                                                                \
  FASTAMP_EMU_HIDDEN void __tsan_atomic##bits##_store(volatile T* a, T v, int /*mo*/) {            \
    fastamp::emu::hook(a, sizeof(T), true, __builtin_return_address(0));                           \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                      \
  }                                                                                                \
  FASTAMP_EMU_HIDDEN T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int /*mo*/) {           \
    fastamp::emu::hook(a, sizeof(T), true, __builtin_return_address(0));                           \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  FASTAMP_EMU_HIDDEN T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int /*mo*/) {           \
    fastamp::emu::hook(a, sizeof(T), true, __builtin_return_address(0));                           \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  FASTAMP_EMU_HIDDEN T __tsan_atomic##bits##_exchange(volatile T* a, T v, int /*mo*/) {            \
    fastamp::emu::hook(a, sizeof(T), true, __builtin_return_address(0));                           \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                                \
  FASTAMP_EMU_HIDDEN int __tsan_atomic##bits##_compare_exchange_strong(                            \
      volatile T* a, T* expected, T v, int /*mo*/, int /*fail_mo*/) {                              \
    fastamp::emu::hook(a, sizeof(T), true, __builtin_return_address(0));                           \
    return __atomic_compare_exchange_n(a, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                \
  FASTAMP_EMU_HIDDEN int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* expected,   \
                                                                     T v, int mo, int fail_mo) {   \
    return __tsan_atomic##bits##_compare_exchange_strong(a, expected, v, mo, fail_mo);             \
  }
FASTAMP_EMU_ATOMIC(8, int8_t)
FASTAMP_EMU_ATOMIC(16, int16_t)
FASTAMP_EMU_ATOMIC(32, int32_t)
FASTAMP_EMU_ATOMIC(64, int64_t)
