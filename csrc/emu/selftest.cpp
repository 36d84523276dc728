// Self-test kernels of the CUDA emulator (emulator library only): CUDA code with a known answer or
// a known fault, so tests/cuda_emu/test_emulator.py can check the emulator's model of barriers,
// warp collectives, atomics and launch limits against what CUDA specifies, and that each kind of
// fault is reported. Written in the same CUDA dialect as csrc/**/*.cu (through common/gpu.cuh).
// The emulator library is a test harness built against the torch it runs with, so it uses
// libtorch's full C++ API; the fastamp sources it compiles use only the stable ABI.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"

#include <string>

namespace fastamp {
namespace emu_selftest {
namespace {

constexpr int kThreads = 512;

// Block sum of the thread indices through the engine's block reduction (shuffles + barrier).
__global__ void block_reduce_kernel(float* out) {
  const float v = static_cast<float>(threadIdx.x);
  const float s = mta_block_reduce<kThreads>(v, [](float a, float b) { return a + b; }, 0.0f);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

// Each shuffle flavour with width 8 and 32; out[k * 32 + lane] per flavour k.
__global__ void shuffle_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x);
  const int v = 100 + lane;
  out[0 * 32 + lane] = __shfl_down_sync(0xffffffffu, v, 3, 8);
  out[1 * 32 + lane] = __shfl_up_sync(0xffffffffu, v, 2, 8);
  out[2 * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, 5, 32);
  out[3 * 32 + lane] = __shfl_sync(0xffffffffu, v, 9, 8);
  out[4 * 32 + lane] = __shfl_down_sync(0xffffffffu, v, 16);
  __syncwarp();
  // A partial mask: lanes 0-15 among themselves.
  if (lane < 16)
    out[5 * 32 + lane] = __shfl_xor_sync(0x0000ffffu, v, 1, 16);
  else
    out[5 * 32 + lane] = -1;
}

// Shared memory written by thread i, read by thread (i + 1) % n after the barrier.
__global__ void shared_kernel(int* out) {
  __shared__ int buf[kThreads];
  buf[threadIdx.x] = static_cast<int>(threadIdx.x * 3 + blockIdx.x);
  __syncthreads();
  out[blockIdx.x * kThreads + threadIdx.x] = buf[(threadIdx.x + 1) % kThreads];
}

__global__ void atomics_kernel(float* f, unsigned long long* u) {
  atomicAdd(f, 0.5f);
  atomicAdd(u, static_cast<unsigned long long>(threadIdx.x + 1));
}

// The global order in which threads start: out[block * blockDim + thread] = arrival rank.
__global__ void arrival_kernel(int* counter, int* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1);
}

// --- memory traffic (tests/cuda_emu/test_traffic.py) --------------------------------------------
// Grid-stride kernels over n floats whose requests and sectors are known in closed form.

__global__ void copy_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = in[i];
  }
}

// Lane i of a warp reads element 8 * i: one sector per lane instead of one per 8 lanes.
__global__ void strided_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = in[(static_cast<int64_t>(i) * 8) % n + (static_cast<int64_t>(i) * 8) / n];
  }
}

// Reads its input twice: once for a sum, once for the output.
__global__ void twice_kernel(const float* in, float* out, int n) {
  float s = 0.0f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    s += in[i];
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = in[i] + s * 0.0f;
  }
}

// Every thread reads one scalar: one sector per warp request.
__global__ void broadcast_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = in[0];
  }
}

// Stages each block's slice through shared memory: the shared accesses are not global traffic.
__global__ void staged_kernel(const float* in, float* out, int n) {
  __shared__ float buf[kThreads];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  buf[threadIdx.x] = in[i];
  __syncthreads();
  out[i] = buf[(threadIdx.x + 1) % blockDim.x] + static_cast<float>(n) * 0.0f;
}

// Stores through inline assembly, which no compiler instrumentation sees: the store a trace
// misses, and the footprint check must catch.
__global__ void bypass_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float v = in[i];
#if defined(__x86_64__)
    asm volatile("movl %1, %0" : "=m"(out[i]) : "r"(__builtin_bit_cast(uint32_t, v)) : "memory");
#else
    out[i] = v;
#endif
  }
}

// 16-byte vectors: one request of 512 bytes per warp.
__global__ void vector_kernel(const float* in, float* out, int n) {
  using V = gpu::Vec<float, 4>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; 4 * i < n; i += gridDim.x * blockDim.x) {
    gpu::vec_store(reinterpret_cast<V*>(out) + i,
                   gpu::vec_load(reinterpret_cast<const V*>(in) + i));
  }
}

// --- faults ------------------------------------------------------------------------------------

__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 100) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void exit_before_barrier_kernel(int* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void lane_outside_mask_kernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0x1u, static_cast<int>(threadIdx.x), 0);
}

__global__ void read_outside_mask_kernel(int* out) {
  if (threadIdx.x < 2) out[threadIdx.x] = __shfl_down_sync(0x3u, static_cast<int>(threadIdx.x), 2);
}

__global__ void shuffle_vs_barrier_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x == 0) {
    __syncthreads();
  } else if (threadIdx.x < 32) {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

__global__ void misaligned_kernel(const float* p, float* out) {
  struct alignas(16) V {
    float v[4];
  };
  const V x = gpu::vec_load(reinterpret_cast<const V*>(p + 1));
  out[threadIdx.x] = x.v[0];
}

// A 4-byte load two bytes off its alignment: x86 takes it, a GPU faults.
__global__ void misaligned_scalar_kernel(const float* p, float* out) {
  const auto* q = reinterpret_cast<const float*>(reinterpret_cast<const char*>(p) + 2);
  out[threadIdx.x] = q[threadIdx.x];
}

struct Big {
  char bytes[4100];
};

__global__ void big_params_kernel(Big b, int* out) {
  out[0] = b.bytes[0];
}

__global__ void write_kernel(int* out) {
  out[threadIdx.x] = 1;
}

at::Tensor selftest(const std::string& kind) {
  const gpu::Stream s{};
  auto i32 = at::TensorOptions().dtype(at::kInt);
  if (kind == "block_reduce") {
    at::Tensor out = at::zeros({3}, at::kFloat);
    gpu::launch("block_reduce_kernel", &block_reduce_kernel, dim3(3), dim3(kThreads), s,
                out.data_ptr<float>());
    return out;
  }
  if (kind == "shuffle") {
    at::Tensor out = at::zeros({6 * 32}, i32);
    gpu::launch("shuffle_kernel", &shuffle_kernel, dim3(1), dim3(32), s, out.data_ptr<int>());
    return out;
  }
  if (kind == "shared") {
    at::Tensor out = at::zeros({2 * kThreads}, i32);
    gpu::launch("shared_kernel", &shared_kernel, dim3(2), dim3(kThreads), s, out.data_ptr<int>());
    return out;
  }
  if (kind == "arrival") {
    at::Tensor counter = at::zeros({1}, i32);
    at::Tensor out = at::zeros({3 * 64}, i32);
    gpu::launch("arrival_kernel", &arrival_kernel, dim3(3), dim3(64), s, counter.data_ptr<int>(),
                out.data_ptr<int>());
    return out;
  }
  if (kind == "atomics") {
    at::Tensor f = at::zeros({1}, at::kFloat);
    at::Tensor u = at::zeros({1}, at::kLong);
    gpu::launch("atomics_kernel", &atomics_kernel, dim3(4), dim3(kThreads), s, f.data_ptr<float>(),
                reinterpret_cast<unsigned long long*>(u.data_ptr<int64_t>()));
    return at::cat({f.to(at::kDouble), u.to(at::kDouble)});
  }
  if (kind == "copy" || kind == "strided" || kind == "twice" || kind == "broadcast" ||
      kind == "staged" || kind == "vector" || kind == "bypass") {
    constexpr int n = 8 * kThreads;
    at::Tensor in = at::arange(n, at::kFloat);
    at::Tensor out = at::zeros({n}, at::kFloat);
    using K = void (*)(const float*, float*, int);
    const K k = kind == "copy"        ? &copy_kernel
                : kind == "strided"   ? &strided_kernel
                : kind == "twice"     ? &twice_kernel
                : kind == "broadcast" ? &broadcast_kernel
                : kind == "staged"    ? &staged_kernel
                : kind == "bypass"    ? &bypass_kernel
                                      : &vector_kernel;
    // Two blocks of kThreads: a grid stride of 2 * kThreads elements (staged: one per element).
    const unsigned blocks = kind == "staged" ? n / kThreads : 2;
    gpu::launch(kind.c_str(), k, dim3(blocks), dim3(kThreads), s,
                static_cast<const float*>(in.data_ptr<float>()), out.data_ptr<float>(), n);
    return out;
  }
  at::Tensor out = at::zeros({kThreads}, i32);
  int* o = out.data_ptr<int>();
  if (kind == "divergent_barrier") {
    gpu::launch("divergent_barrier_kernel", &divergent_barrier_kernel, dim3(1), dim3(kThreads), s,
                o);
  } else if (kind == "exit_before_barrier") {
    gpu::launch("exit_before_barrier_kernel", &exit_before_barrier_kernel, dim3(1), dim3(64), s, o);
  } else if (kind == "lane_outside_mask") {
    gpu::launch("lane_outside_mask_kernel", &lane_outside_mask_kernel, dim3(1), dim3(32), s, o);
  } else if (kind == "read_outside_mask") {
    gpu::launch("read_outside_mask_kernel", &read_outside_mask_kernel, dim3(1), dim3(32), s, o);
  } else if (kind == "shuffle_vs_barrier") {
    gpu::launch("shuffle_vs_barrier_kernel", &shuffle_vs_barrier_kernel, dim3(1), dim3(64), s, o);
  } else if (kind == "misaligned") {
    at::Tensor src = at::zeros({64}, at::kFloat);
    gpu::launch("misaligned_kernel", &misaligned_kernel, dim3(1), dim3(32), s,
                static_cast<const float*>(src.data_ptr<float>()), src.data_ptr<float>());
  } else if (kind == "misaligned_scalar") {
    at::Tensor src = at::zeros({64}, at::kFloat);
    gpu::launch("misaligned_scalar_kernel", &misaligned_scalar_kernel, dim3(1), dim3(32), s,
                static_cast<const float*>(src.data_ptr<float>()), src.data_ptr<float>() + 33);
  } else if (kind == "big_params") {
    gpu::launch("big_params_kernel", &big_params_kernel, dim3(1), dim3(1), s, Big{}, o);
  } else if (kind == "empty_grid") {
    gpu::launch("write_kernel", &write_kernel, dim3(0), dim3(32), s, o);
  } else if (kind == "too_many_threads") {
    gpu::launch("write_kernel", &write_kernel, dim3(1), dim3(1025), s, o);
  } else if (kind == "block_z_too_large") {
    gpu::launch("write_kernel", &write_kernel, dim3(1), dim3(1, 1, 65), s, o);
  } else {
    TORCH_CHECK_VALUE(false, "fastamp_emu::selftest: unknown kind '", kind, "'");
  }
  return out;
}

}  // namespace
}  // namespace emu_selftest
}  // namespace fastamp

TORCH_LIBRARY_FRAGMENT(fastamp_emu, m) {
  // Runs one self-test kernel (see above); returns its output, or raises the emulator's report.
  m.def("selftest(str kind) -> Tensor", &fastamp::emu_selftest::selftest);
}
