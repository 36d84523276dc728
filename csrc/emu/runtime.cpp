// The CUDA execution emulator's scheduler (see runtime.h for the model). One block at a time: its
// threads are fibers on the calling OS thread; a fiber runs until it reaches a barrier
// or a warp collective that cannot complete yet, or exits, and the scheduler then picks the next
// runnable fiber in the launch's order.
//
// Over 400 lines because the scheduler, the fiber switch (hand-written on x86-64, ucontext
// elsewhere) with its AddressSanitizer annotations, the barrier and the warp collectives all work
// on one piece of file-local state, the block being run and its current fiber; splitting them
// would export that state through a header for no reader's benefit. The file is sectioned in that
// order: fiber contexts, the block run, launch, __syncthreads, warp collectives.
#include "emu/runtime.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FASTAMP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FASTAMP_EMU_ASAN 1
#endif
#endif

#if defined(FASTAMP_EMU_ASAN)
// ASan must be told about stack switches, or it reports the fibers' stacks as overflows.
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif

namespace fastamp {
namespace emu {

thread_local const ThreadCtx* tl_ctx = nullptr;

namespace {

constexpr int kWarp = 32;
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned kMaxGridDim[3] = {2147483647u, 65535, 65535};
#if defined(FASTAMP_EMU_ASAN)
constexpr size_t kStackBytes = 512 * 1024;  // ASan's redzones and fake frames need room
#else
constexpr size_t kStackBytes = 128 * 1024;
#endif

std::atomic<int> g_order{static_cast<int>(Order::kAscending)};
std::atomic<uint64_t> g_seed{0};
std::atomic<uint64_t> g_launch_counter{0};
std::mutex g_stats_mu;
Stats g_stats;
std::set<std::string> g_launched;

// --- fiber contexts ----------------------------------------------------------------------------
// x86-64: a minimal switch that saves the callee-saved registers and the FP control words on the
// old stack and swaps stack pointers (glibc's swapcontext makes a sigprocmask system call per
// switch, which made the emulator several times slower). Elsewhere: ucontext.
#if defined(__x86_64__)
extern "C" void fastamp_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl fastamp_emu_switch
  .hidden fastamp_emu_switch
  .type fastamp_emu_switch,@function
fastamp_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fastamp_emu_switch,.-fastamp_emu_switch
)");

struct Context {
  void* sp = nullptr;
  char* stack = nullptr;
  size_t size = 0;
};

/// Prepares ctx to start entry() on [stack, stack + size) at its first switch_to.
void init_context(Context& ctx, char* stack, size_t size, void (*entry)()) {
#if defined(FASTAMP_EMU_ASAN)
  // A reused stack still carries the redzones of the frames its last fiber never unwound.
  __asan_unpoison_memory_region(stack, size);
#endif
  ctx.stack = stack;
  ctx.size = size;
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15};
  auto* w = reinterpret_cast<uint64_t*>(top);
  w[-1] = 0;                                  // entry's return address: it never returns
  w[-2] = reinterpret_cast<uint64_t>(entry);  // popped by `ret`
  for (int r = 3; r <= 8; ++r) w[-r] = 0;     // rbp rbx r12 r13 r14 r15
  uint32_t mxcsr;
  uint16_t fcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fcw));
  auto* cw = reinterpret_cast<char*>(&w[-10]);  // 16 bytes: fcw at +0, mxcsr at +8
  std::memcpy(cw, &fcw, sizeof(fcw));
  std::memcpy(cw + 8, &mxcsr, sizeof(mxcsr));
  ctx.sp = cw;
}

inline void switch_to(Context& from, Context& to) {
  fastamp_emu_switch(&from.sp, to.sp);
}
#else
struct Context {
  ucontext_t uc;
  char* stack = nullptr;
  size_t size = 0;
};

void init_context(Context& ctx, char* stack, size_t size, void (*entry)()) {
#if defined(FASTAMP_EMU_ASAN)
  __asan_unpoison_memory_region(stack, size);  // see the x86-64 version
#endif
  static thread_local ucontext_t tmpl;
  static thread_local bool have_tmpl = false;
  if (!have_tmpl) {  // getcontext makes a system call: once per OS thread
    getcontext(&tmpl);
    have_tmpl = true;
  }
  ctx.stack = stack;
  ctx.size = size;
  ctx.uc = tmpl;
  ctx.uc.uc_stack.ss_sp = stack;
  ctx.uc.uc_stack.ss_size = size;
  ctx.uc.uc_link = nullptr;
  makecontext(&ctx.uc, entry, 0);
}

inline void switch_to(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
#endif

enum class State : uint8_t { kReady, kBarrier, kWarp, kDone };

const char* warp_op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSync:
      return "__syncwarp";
    case WarpOp::kShflIdx:
      return "__shfl_sync";
    case WarpOp::kShflUp:
      return "__shfl_up_sync";
    case WarpOp::kShflDown:
      return "__shfl_down_sync";
    case WarpOp::kShflXor:
      return "__shfl_xor_sync";
  }
  return "?";
}

struct Fiber {
  Context uc;
  ThreadCtx ctx;
  State state = State::kReady;
  unsigned tid = 0;  // linear thread index within the block
  bool started = false;
  // the pending warp collective
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  int arg = 0;
  int width = kWarp;
  uint64_t in = 0;
  uint64_t out = 0;
};

/// Fiber stacks, allocated once per OS thread and reused by every block it runs.
struct StackPool {
  std::vector<std::unique_ptr<char[]>> stacks;
  char* get(size_t i) {
    while (stacks.size() <= i) stacks.emplace_back(new char[kStackBytes]);
    return stacks[i].get();
  }
};

struct BlockRun {
  const char* kernel = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  Context sched;
  Fiber* cur = nullptr;
  unsigned live = 0;
  unsigned at_barrier = 0;
  unsigned exited = 0;
  int64_t switches = 0;
  std::string error;
#if defined(FASTAMP_EMU_ASAN)
  void* fake_stack = nullptr;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
};

thread_local BlockRun* tl_run = nullptr;
thread_local StackPool tl_stacks;

std::string where(const Fiber& f) {
  std::ostringstream s;
  s << "block (" << f.ctx.block_idx.x << "," << f.ctx.block_idx.y << "," << f.ctx.block_idx.z
    << ") thread (" << f.ctx.thread_idx.x << "," << f.ctx.thread_idx.y << "," << f.ctx.thread_idx.z
    << ")";
  return s.str();
}

// Switch from the running fiber back to the scheduler.
void to_scheduler(BlockRun& run) {
  Fiber* f = run.cur;
#if defined(FASTAMP_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(f->state == State::kDone ? nullptr : &fake, run.sched_bottom,
                                 run.sched_size);
  switch_to(f->uc, run.sched);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  switch_to(f->uc, run.sched);
#endif
  tl_ctx = &f->ctx;  // resumed: this fiber runs again
}

void record_error(BlockRun& run, const std::string& what) {
  if (run.error.empty()) run.error = what;
}

// Marks the current fiber failed and never returns to it.
[[noreturn]] void abandon(BlockRun& run, const std::string& what) {
  record_error(run, where(*run.cur) + ": " + what);
  run.cur->state = State::kDone;
  to_scheduler(run);
  std::abort();  // unreachable: a done fiber is never resumed
}

void fiber_main() {
  BlockRun& run = *tl_run;
#if defined(FASTAMP_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &run.sched_bottom, &run.sched_size);
#endif
  Fiber& f = *run.cur;
  try {
    (*run.body)();
  } catch (const std::exception& e) {
    record_error(run, where(f) + ": exception in kernel code: " + e.what());
  } catch (...) {
    record_error(run, where(f) + ": unknown exception in kernel code");
  }
  f.state = State::kDone;
  --run.live;
  ++run.exited;
  if (run.error.empty()) {
    // CUDA's barrier counts the threads of the block; one that leaves while others wait (or
    // before they arrive) is a divergent __syncthreads.
    if (run.at_barrier > 0) {
      record_error(run, where(f) + " exited while " + std::to_string(run.at_barrier) +
                            " thread(s) of its block wait at __syncthreads()");
    }
    // A lane that leaves while lanes of its warp wait for it in a collective.
    const unsigned warp = f.tid / kWarp;
    const unsigned lane = f.tid % kWarp;
    for (unsigned l = 0; l < kWarp && run.error.empty(); ++l) {
      const unsigned t = warp * kWarp + l;
      if (t >= run.fibers.size()) break;
      const Fiber& o = run.fibers[t];
      if (o.state == State::kWarp && (o.mask >> lane & 1u)) {
        record_error(
            run, where(f) + " exited while " + where(o) + " waits for it in " + warp_op_name(o.op) +
                     "(mask=0x" +
                     [&] {
                       std::ostringstream h;
                       h << std::hex << o.mask;
                       return h.str();
                     }() +
                     ")");
      }
    }
  }
  to_scheduler(run);
  std::abort();  // unreachable
}

// Runs fiber f until it blocks or exits.
void resume(BlockRun& run, Fiber& f) {
  run.cur = &f;
  tl_ctx = &f.ctx;
  ++run.switches;
#if defined(FASTAMP_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.uc.stack, f.uc.size);
  switch_to(run.sched, f.uc);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  switch_to(run.sched, f.uc);
#endif
  tl_ctx = nullptr;
  run.cur = nullptr;
}

std::string describe_states(const BlockRun& run) {
  std::ostringstream s;
  int shown = 0;
  for (const Fiber& f : run.fibers) {
    if (f.state == State::kDone) continue;
    if (shown++ == 8) {
      s << "; ...";
      break;
    }
    s << "; thread " << f.tid << " waits at "
      << (f.state == State::kBarrier ? "__syncthreads()" : warp_op_name(f.op));
    if (f.state == State::kWarp) s << "(mask=0x" << std::hex << f.mask << std::dec << ")";
  }
  return s.str();
}

std::vector<unsigned> make_order(unsigned n, Order order, std::mt19937_64& rng) {
  std::vector<unsigned> v(n);
  std::iota(v.begin(), v.end(), 0u);
  if (order == Order::kDescending) std::reverse(v.begin(), v.end());
  if (order == Order::kRandom) std::shuffle(v.begin(), v.end(), rng);
  return v;
}

void run_block(BlockRun& run, const dim3& block, const uint3& bidx, const dim3& grid, Order order,
               std::mt19937_64& rng) {
  const unsigned n = block.x * block.y * block.z;
  run.fibers.resize(n);
  run.live = n;
  run.at_barrier = 0;
  run.exited = 0;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = run.fibers[t];
    f.state = State::kReady;
    f.tid = t;
    f.ctx.thread_idx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    f.ctx.block_idx = bidx;
    f.ctx.block_dim = block;
    f.ctx.grid_dim = grid;
    init_context(f.uc, tl_stacks.get(t), kStackBytes, &fiber_main);
  }
  std::vector<unsigned> ord = make_order(n, order, rng);
  while (run.live > 0 && run.error.empty()) {
    bool progressed = false;
    for (unsigned t : ord) {
      Fiber& f = run.fibers[t];
      if (f.state != State::kReady) continue;
      progressed = true;
      resume(run, f);
      if (!run.error.empty()) return;
    }
    if (!progressed) {
      record_error(run, "deadlock in block (" + std::to_string(bidx.x) + "," +
                            std::to_string(bidx.y) + "," + std::to_string(bidx.z) +
                            "): no thread can proceed" + describe_states(run));
      return;
    }
    if (order == Order::kRandom) std::shuffle(ord.begin(), ord.end(), rng);
  }
}

}  // namespace

void set_order(Order order, uint64_t seed) {
  g_order.store(static_cast<int>(order));
  g_seed.store(seed);
  g_launch_counter.store(0);  // the same launches after the same set_order: the same schedules
}

Order order() {
  return static_cast<Order>(g_order.load());
}

Stats stats() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return g_stats;
}

void reset_stats() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  g_stats = Stats{};
  reset_traffic();
}

std::vector<std::string> launched_kernels() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return {g_launched.begin(), g_launched.end()};
}

bool current_fiber(FiberView* out) {
  const BlockRun* run = tl_run;
  if (run == nullptr || run->cur == nullptr) return false;
  const Fiber& f = *run->cur;
  out->tid = f.tid;
  out->stack_lo = reinterpret_cast<uintptr_t>(f.uc.stack);
  out->stack_hi = out->stack_lo + f.uc.size;
  out->book_lo = reinterpret_cast<uintptr_t>(run->fibers.data());
  out->book_hi = reinterpret_cast<uintptr_t>(run->fibers.data() + run->fibers.size());
  return true;
}

void fail_outside_kernel() {
  TORCH_CHECK(false,
              "CUDA emulator: a CUDA built-in (threadIdx, __syncthreads, ...) was used "
              "outside a kernel launch");
  std::abort();
}

void device_error(const std::string& what) {
  BlockRun* run = tl_run;
  if (run == nullptr || run->cur == nullptr) fail_outside_kernel();
  abandon(*run, what);
}

void syncthreads() {
  BlockRun* run = tl_run;
  if (run == nullptr || run->cur == nullptr) fail_outside_kernel();
  Fiber& f = *run->cur;
  const unsigned warp = f.tid / kWarp;
  const unsigned lane = f.tid % kWarp;
  for (unsigned l = 0; l < kWarp; ++l) {
    const unsigned t = warp * kWarp + l;
    if (t >= run->fibers.size()) break;
    const Fiber& o = run->fibers[t];
    if (o.state == State::kWarp && (o.mask >> lane & 1u)) {
      abandon(*run, std::string("__syncthreads() reached while ") + where(o) +
                        " waits for this "
                        "lane in " +
                        warp_op_name(o.op) + " (divergent warp collective)");
    }
  }
  if (run->exited > 0) {
    abandon(*run, "__syncthreads() reached after " + std::to_string(run->exited) +
                      " thread(s) of the block exited (a divergent barrier)");
  }
  f.state = State::kBarrier;
  if (++run->at_barrier == run->live) {  // the last to arrive releases everyone
    for (Fiber& o : run->fibers) {
      if (o.state == State::kBarrier) o.state = State::kReady;
    }
    run->at_barrier = 0;
    return;
  }
  to_scheduler(*run);
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
  BlockRun* run = tl_run;
  if (run == nullptr || run->cur == nullptr) fail_outside_kernel();
  Fiber& f = *run->cur;
  const unsigned warp = f.tid / kWarp;
  const unsigned lane = f.tid % kWarp;
  const char* name = warp_op_name(op);
  auto hex = [](unsigned m) {
    std::ostringstream h;
    h << "0x" << std::hex << m;
    return h.str();
  };
  if (!(mask >> lane & 1u)) {
    abandon(*run, std::string(name) + " with mask " + hex(mask) +
                      " that does not name the "
                      "calling lane " +
                      std::to_string(lane));
  }
  if (op != WarpOp::kSync && (width <= 0 || width > kWarp || (width & (width - 1)) != 0)) {
    abandon(*run, std::string(name) + " with width " + std::to_string(width) +
                      "; expected a power of 2 in [1, 32]");
  }
  f.state = State::kWarp;
  f.op = op;
  f.mask = mask;
  f.arg = arg;
  f.width = width;
  f.in = value;
  // Has every lane of the mask arrived at a collective?
  bool all = true;
  for (unsigned l = 0; l < kWarp; ++l) {
    if (!(mask >> l & 1u)) continue;
    const unsigned t = warp * kWarp + l;
    if (t >= run->fibers.size()) {
      abandon(*run, std::string(name) + " mask " + hex(mask) + " names lane " + std::to_string(l) +
                        ", which does not exist in a block of " +
                        std::to_string(run->fibers.size()) + " threads");
    }
    const Fiber& o = run->fibers[t];
    if (o.state == State::kDone) {
      abandon(*run, std::string(name) + " mask " + hex(mask) + " names lane " + std::to_string(l) +
                        ", which has exited");
    }
    if (o.state == State::kBarrier) {
      abandon(*run, std::string(name) + " mask " + hex(mask) + " names lane " + std::to_string(l) +
                        ", which waits at __syncthreads() (divergent warp collective)");
    }
    if (o.state != State::kWarp) {
      all = false;
      continue;
    }
    if (o.op != op || o.mask != mask || (op != WarpOp::kSync && o.width != width)) {
      abandon(*run, std::string(name) + "(mask=" + hex(mask) + ") meets lane " + std::to_string(l) +
                        " in " + warp_op_name(o.op) + "(mask=" + hex(o.mask) +
                        ") (divergent warp collectives)");
    }
  }
  if (all) {
    // Exchange: each lane of the mask computes its source lane by CUDA's rules.
    for (unsigned l = 0; l < kWarp; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& o = run->fibers[warp * kWarp + l];
      if (op != WarpOp::kSync) {
        const int w = o.width;
        const int seg = static_cast<int>(l) & ~(w - 1);  // first lane of this lane's segment
        int src = static_cast<int>(l);
        switch (op) {
          case WarpOp::kShflIdx:
            src = seg + (o.arg & (w - 1));
            break;
          case WarpOp::kShflUp:
            if (static_cast<int>(l) - seg >= o.arg) src = static_cast<int>(l) - o.arg;
            break;
          case WarpOp::kShflDown:
            if (static_cast<int>(l) - seg + o.arg < w) src = static_cast<int>(l) + o.arg;
            break;
          case WarpOp::kShflXor: {
            const int x = static_cast<int>(l) ^ o.arg;
            if (x < seg + w) src = x;  // a lane past the segment reads its own value
            break;
          }
          case WarpOp::kSync:
            break;
        }
        if (src < 0 || src >= kWarp || !(mask >> src & 1u)) {
          abandon(*run, std::string(name) + "(mask=" + hex(mask) + "): lane " + std::to_string(l) +
                            " reads lane " + std::to_string(src) +
                            ", which is not in the mask (undefined value on a GPU)");
        }
        o.out = run->fibers[warp * kWarp + static_cast<unsigned>(src)].in;
      }
    }
    for (unsigned l = 0; l < kWarp; ++l) {
      if (mask >> l & 1u) run->fibers[warp * kWarp + l].state = State::kReady;
    }
    return f.out;
  }
  to_scheduler(*run);
  return f.out;
}

void run_grid(const char* kernel, dim3 grid, dim3 block, size_t param_size,
              const std::function<void()>& body) {
  const unsigned g[3] = {grid.x, grid.y, grid.z};
  const unsigned b[3] = {block.x, block.y, block.z};
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(g[d] >= 1 && g[d] <= kMaxGridDim[d], "CUDA emulator: launch of ", kernel,
                " refused: grid dimension ", "xyz"[d], " is ", g[d], "; CUDA allows 1..",
                kMaxGridDim[d], " (cudaErrorInvalidConfiguration)");
    TORCH_CHECK(b[d] >= 1 && b[d] <= kMaxBlockDim[d], "CUDA emulator: launch of ", kernel,
                " refused: block dimension ", "xyz"[d], " is ", b[d], "; CUDA allows 1..",
                kMaxBlockDim[d], " (cudaErrorInvalidConfiguration)");
  }
  const uint64_t nthreads = uint64_t{block.x} * block.y * block.z;
  TORCH_CHECK(nthreads <= kMaxThreadsPerBlock, "CUDA emulator: launch of ", kernel,
              " refused: ", nthreads, " threads per block; CUDA allows at most ",
              kMaxThreadsPerBlock);
  TORCH_CHECK(param_size <= kMaxParamBytes, "CUDA emulator: launch of ", kernel,
              " refused: ", param_size, " bytes of kernel parameters; at most ", kMaxParamBytes,
              " are portable (CUDA < 12.1 drivers)");
  TORCH_CHECK(tl_run == nullptr, "CUDA emulator: launch of ", kernel,
              " from inside a kernel (dynamic parallelism is not supported)");

  const Order ord = order();
  // A fresh stream per launch, reproducible from the seed and the launch's ordinal since set_order.
  std::mt19937_64 rng(g_seed.load() ^
                      (0x9e3779b97f4a7c15ull * (g_launch_counter.fetch_add(1) + 1)));
  const uint64_t nblocks = uint64_t{grid.x} * grid.y * grid.z;
  // Block order: the same three orders as the threads within a block.
  std::vector<uint64_t> blocks(nblocks);
  std::iota(blocks.begin(), blocks.end(), uint64_t{0});
  if (ord == Order::kDescending) std::reverse(blocks.begin(), blocks.end());
  if (ord == Order::kRandom) std::shuffle(blocks.begin(), blocks.end(), rng);

  BlockRun run;
  run.kernel = kernel;
  run.body = &body;
  tl_run = &run;
  traffic_launch_begin(kernel);
  for (uint64_t lin : blocks) {
    const uint3 bidx{static_cast<unsigned>(lin % grid.x),
                     static_cast<unsigned>((lin / grid.x) % grid.y),
                     static_cast<unsigned>(lin / (uint64_t{grid.x} * grid.y))};
    run_block(run, block, bidx, grid, ord, rng);
    traffic_block_end();
    if (!run.error.empty()) break;
  }
  traffic_launch_end();
  tl_run = nullptr;
  tl_ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_stats_mu);
    g_stats.launches += 1;
    g_stats.blocks += static_cast<int64_t>(nblocks);
    g_stats.threads += static_cast<int64_t>(nblocks * nthreads);
    g_stats.switches += run.switches;
    g_launched.insert(kernel);
  }
  TORCH_CHECK(run.error.empty(), "CUDA emulator: kernel ", kernel, ": ", run.error);
}

}  // namespace emu
}  // namespace fastamp
