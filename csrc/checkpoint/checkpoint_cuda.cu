// CUDA kernel of the tensor digest: per-word terms summed per block, the blocks' sums with 64-bit
// atomics. Addition mod 2^64 commutes, so the bits do not depend on block scheduling, and equal
// the CPU kernel's.
//
// Not on the multi-tensor engine, on purpose: the engine walks typed, element-aligned lists and
// combines float partials in a fixed order so that rounding is reproducible; the digest reads the
// raw bytes of any storage offset (byte loads, no alignment) and its sum is exact integer
// arithmetic, for which every order gives the same bits. Routing it through the engine would add
// a partials buffer and a second launch and change nothing in the result.
#include "common/torch_api.h"

#include "checkpoint/digest_checks.h"
#include "common/gpu.cuh"
#include "checkpoint/digest_math.h"

namespace fastamp {
namespace checkpoint {
namespace {

constexpr int kThreads = 256;

// kWords: the storage starts on an 8-byte boundary, so each full word is one 8-byte load (a
// warp reads 256 contiguous bytes: 8 sectors in one request). Otherwise byte loads, which a warp
// issues 8 times over the same sectors (any storage offset is allowed).
template <bool kWords>
__global__ void digest_kernel(const uint8_t* p, int64_t nbytes, unsigned long long* sum) {
  const int64_t nwords = (nbytes + 7) / 8;
  uint64_t s = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < nwords;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    uint64_t w = 0;
    const int64_t left = nbytes - i * 8;
    if (kWords && left >= 8) {
      w = reinterpret_cast<const uint64_t*>(p)[i];  // little-endian, as the bytes below
    } else if (left >= 8) {
#pragma unroll
      for (int b = 0; b < 8; ++b) w |= static_cast<uint64_t>(p[i * 8 + b]) << (8 * b);
    } else {
      for (int b = 0; b < left; ++b) w |= static_cast<uint64_t>(p[i * 8 + b]) << (8 * b);
    }
    s += digest_term(w, static_cast<uint64_t>(i));
  }
  // One atomic per block, not per thread (every thread gets here): the sum is exact, so the
  // reduction order changes nothing.
  __shared__ uint64_t warp_sums[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t b = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) b += warp_sums[w];
    atomicAdd(sum, static_cast<unsigned long long>(b));
  }
}

__global__ void finish_kernel(unsigned long long* sums, const int64_t* nbytes, int64_t n,
                              int64_t* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    out[i] = static_cast<int64_t>(digest_finish(sums[i], static_cast<uint64_t>(nbytes[i])));
  }
}

Tensor tensor_digest_cuda(TensorList tensors) {
  FASTAMP_CHECK(!tensors.empty(), "fastamp::tensor_digest: the CUDA kernel needs a tensor");
  const Device device = tensors[0].device();
  gpu::check_device(device, "fastamp::tensor_digest", "tensors[0]");
  const auto dense = check_digest(tensors, device);
  gpu::DeviceGuard guard(device);
  const gpu::Stream stream = gpu::current_stream(device);
  const auto n = static_cast<int64_t>(tensors.size());
  Tensor sums = zeros({n}, kLong, device);
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto& t = dense[static_cast<size_t>(i)];
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    sizes[static_cast<size_t>(i)] = nbytes;
    if (nbytes == 0) continue;
    const int64_t nwords = (nbytes + 7) / 8;
    const int blocks =
        static_cast<int>(std::min<int64_t>((nwords + kThreads - 1) / kThreads, 1024));
    const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
    auto* sum = reinterpret_cast<unsigned long long*>(sums.mutable_data_ptr<int64_t>()) + i;
    if (reinterpret_cast<uintptr_t>(bytes) % 8 == 0) {
      gpu::launch("digest_kernel", &digest_kernel<true>, dim3(static_cast<unsigned>(blocks)),
                  dim3(kThreads), stream, bytes, nbytes, sum);
    } else {
      gpu::launch("digest_kernel", &digest_kernel<false>, dim3(static_cast<unsigned>(blocks)),
                  dim3(kThreads), stream, bytes, nbytes, sum);
    }
  }
  // The sizes travel as a small host-to-device copy from a CPU tensor (stream-ordered).
  Tensor host_sizes = empty({n}, kLong, Device(DeviceType::CPU));
  std::copy(sizes.begin(), sizes.end(), host_sizes.mutable_data_ptr<int64_t>());
  Tensor nbytes = to_device(host_sizes, device, /*non_blocking=*/false);
  Tensor out = empty({n}, kLong, device);
  gpu::launch("finish_kernel", &finish_kernel, dim3(static_cast<unsigned>((n + 255) / 256)),
              dim3(256), stream,
              reinterpret_cast<unsigned long long*>(sums.mutable_data_ptr<int64_t>()),
              static_cast<const int64_t*>(nbytes.mutable_data_ptr<int64_t>()), n,
              out.mutable_data_ptr<int64_t>());
  return out;
}

}  // namespace
}  // namespace checkpoint
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  m.impl("tensor_digest", TORCH_BOX(&fastamp::checkpoint::tensor_digest_cuda));
}
