/// @file gpu.cuh
/// Everything the CUDA sources take from the CUDA runtime and from torch's stable CUDA layer, in
/// one small header, so that each .cu file compiles unchanged
///  - with nvcc, for GPUs (the product), and
///  - with a host C++ compiler and FASTAMP_CUDA_EMULATOR defined, for the CUDA emulator
///    (csrc/emu), which runs the same kernels and host launchers on the CPU in CI.
/// Kernels are launched with gpu::launch (never `<<<...>>>` at a call site), registered with
/// FASTAMP_CUDA_KERNELS, and do 16-byte vector accesses through gpu::vec_load / vec_store.
#pragma once

#include "common/torch_api.h"

#include <cstdint>
#include <utility>

#if defined(FASTAMP_CUDA_EMULATOR)
#include "emu/cuda_shim.h"
#else
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#endif

namespace fastamp {
namespace gpu {

#if defined(FASTAMP_CUDA_EMULATOR)
/// The emulated GPU's memory is host memory: its "device tensors" are CPU tensors.
constexpr DeviceType kDeviceType = DeviceType::CPU;
constexpr const char* kDeviceName = "CPU (the CUDA emulator's device memory)";

struct DeviceGuard {
  explicit DeviceGuard(const Device& /*device*/) {}
};

/// The emulator runs each launch to completion before returning: one implicit, ordered stream.
struct Stream {};

inline Stream current_stream(const Device& /*device*/) {
  return Stream{};
}

#else
constexpr DeviceType kDeviceType = DeviceType::CUDA;
constexpr const char* kDeviceName = "CUDA";

/// Makes `device` current for the launches in its scope (torch's device guard, through the stable
/// ABI).
struct DeviceGuard {
  explicit DeviceGuard(const Device& device) : guard_(device.index()) {}

 private:
  torch::stable::accelerator::DeviceGuard guard_;
};

using Stream = cudaStream_t;

/// torch's current CUDA stream on `device`.
inline Stream current_stream(const Device& device) {
  void* stream = nullptr;
  const AOTITorchError err = aoti_torch_get_current_cuda_stream(device.index(), &stream);
  FASTAMP_CHECK(err == AOTI_TORCH_SUCCESS, "fastamp: could not get the current CUDA stream of ",
                device);
  return static_cast<Stream>(stream);
}
#endif

/// The device check every CUDA launcher starts with.
inline void check_device(const Device& device, const char* op, const char* arg) {
  FASTAMP_CHECK(device.type() == kDeviceType, op, ": ", arg, " is on ", device, "; expected a ",
                kDeviceName, " device");
}

/// kernel<<<grid, block, 0, stream>>>(args...), then the launch-error check. Under the emulator
/// the launch runs to completion here, with the checks CUDA makes at launch (grid and block
/// limits, the 4 KiB parameter limit).
template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, Stream stream,
            A&&... args) {
#if defined(FASTAMP_CUDA_EMULATOR)
  (void)stream;
  ::fastamp::emu::launch(name, kernel, grid, block, std::forward<A>(args)...);
#else
  kernel<<<grid, block, 0, stream>>>(std::forward<A>(args)...);
  const cudaError_t err = cudaGetLastError();
  FASTAMP_CHECK(err == cudaSuccess, "CUDA error in ", name, ": ", cudaGetErrorString(err));
#endif
}

/// The one vector-access type: N elements of T, aligned to their size (16 bytes for the engine's
/// chunk loop; the optimizers' 4-element groups, 8 or 16 bytes by dtype). Loaded and stored only
/// through vec_load / vec_store.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

/// The address of the instruction this expands at: under the emulator, the identity of an
/// inlined vector access, so the lanes of a warp that run it form one request (emu/traffic.h).
#if defined(FASTAMP_CUDA_EMULATOR) && defined(__x86_64__)
#define FASTAMP_EMU_PC()                          \
  [] {                                            \
    const void* pc;                               \
    asm volatile("leaq 0(%%rip), %0" : "=r"(pc)); \
    return pc;                                    \
  }()
#elif defined(FASTAMP_CUDA_EMULATOR)
#define FASTAMP_EMU_PC() __builtin_return_address(0)
#endif

/// Vector load of a V (e.g. 16 bytes) from p, which must be aligned to alignof(V): a GPU faults
/// on a misaligned vector access, and the emulator reports one. Under the emulator the copy is
/// one counted access (the host compiler might split `*p` into scalar loads).
template <typename V>
__host__ __device__ __forceinline__ V vec_load(const V* p) {
#if defined(FASTAMP_CUDA_EMULATOR)
  ::fastamp::emu::check_aligned(p, alignof(V), "vector load");
  V out;
  ::fastamp::emu::vector_access(&out, p, sizeof(V), /*store=*/false, FASTAMP_EMU_PC());
  return out;
#else
  return *p;
#endif
}

template <typename V>
__host__ __device__ __forceinline__ void vec_store(V* p, const V& v) {
#if defined(FASTAMP_CUDA_EMULATOR)
  ::fastamp::emu::check_aligned(p, alignof(V), "vector store");
  ::fastamp::emu::vector_access(p, &v, sizeof(V), /*store=*/true, FASTAMP_EMU_PC());
#else
  *p = v;
#endif
}

}  // namespace gpu
}  // namespace fastamp

/// Registers a capability's CUDA kernels: with the fastamp ops' CUDA dispatch key on GPU builds;
/// under the emulator, as CPU kernels of the mirror namespace `fastamp_emu` (whose schemas the
/// test harness copies from fastamp's), so emulated and CPU kernels can be compared side by side.
#if defined(FASTAMP_CUDA_EMULATOR)
#define FASTAMP_CUDA_KERNELS(m) STABLE_TORCH_LIBRARY_IMPL(fastamp_emu, CPU, m)
#else
#define FASTAMP_CUDA_KERNELS(m) STABLE_TORCH_LIBRARY_IMPL(fastamp, CUDA, m)
#endif
