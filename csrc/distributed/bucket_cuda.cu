// CUDA kernels of the gradient-bucket ops: one launch per op over all slots (a block per chunk,
// with the slot table in device memory), the unpack's sums combined in a fixed order.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "common/gpu.cuh"
#include "common/multi_tensor_apply.h"
#include "distributed/bucket_checks.h"
#include "scaler/scaler_math.h"

#include <vector>

namespace fastamp {
namespace distributed {
namespace {

constexpr int kThreads = 256;

struct DevChunk {
  void* grad;        // the slot's grad, at the chunk's first element
  int64_t offset;    // bucket element of the chunk's first element
  int64_t len;
};

// The chunk table travels as one small host-to-device copy (pinned, async, stream-ordered).
at::Tensor chunk_table(const std::vector<Slot>& slots, size_t elem, const c10::Device& dev,
                       int64_t* n_out) {
  std::vector<FlatTensor> flat;
  for (size_t i = 0; i < slots.size(); ++i) {
    flat.push_back(FlatTensor{slots[i].grad, slots[i].numel, at::kFloat, static_cast<int64_t>(i)});
  }
  const auto chunks = plan_chunks(flat);
  *n_out = static_cast<int64_t>(chunks.size());
  at::Tensor host = at::empty({static_cast<int64_t>(chunks.size() * sizeof(DevChunk))},
                              gpu::staging_options());
  auto* t = reinterpret_cast<DevChunk*>(host.data_ptr());
  for (size_t c = 0; c < chunks.size(); ++c) {
    const Slot& s = slots[static_cast<size_t>(chunks[c].item)];
    t[c] = DevChunk{static_cast<char*>(s.grad) + chunks[c].start * static_cast<int64_t>(elem),
                    s.offset + chunks[c].start, chunks[c].len};
  }
  return host.to(dev, /*non_blocking=*/true);
}

template <typename T>
__global__ void pack_kernel(T* bucket, const DevChunk* table, float scale) {
  const DevChunk c = table[blockIdx.x];
  const T* g = static_cast<const T*>(c.grad);
  for (int64_t i = threadIdx.x; i < c.len; i += kThreads) {
    bucket[c.offset + i] = static_cast<T>(static_cast<float>(g[i]) * scale);
  }
}

template <typename T>
__global__ void unpack_kernel(const T* bucket, const DevChunk* table, const float* inv_scale,
                              float* partials, float* found_inf) {
  const DevChunk c = table[blockIdx.x];
  T* g = static_cast<T*>(c.grad);
  const float inv = *inv_scale;
  float acc = 0.0f;
  float probe = 0.0f;
  for (int64_t i = threadIdx.x; i < c.len; i += kThreads) {
    const T x = bucket[c.offset + i];
    g[i] = x;
    const float v = static_cast<float>(x);
    probe += scaler::nonfinite_probe(v);
    const float u = scaler::unscale(v, inv);
    acc += u * u;
  }
  if (probe != 0.0f) *found_inf = 1.0f;  // benign race: every writer stores 1
  __shared__ float sums[kThreads];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {  // fixed tree: deterministic
    if (static_cast<int>(threadIdx.x) < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

__global__ void sum_partials(const float* partials, int64_t n, float* out) {
  __shared__ float sums[kThreads];
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += partials[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sums[0];
}

void bucket_pack_cuda(at::Tensor& bucket, at::TensorList grads, at::IntArrayRef offsets,
                      double scale) {
  gpu::check_device(bucket.device(), "fastamp::bucket_pack_", "bucket");
  const auto slots = check_bucket("fastamp::bucket_pack_", bucket, grads, offsets);
  gpu::DeviceGuard guard(bucket.device());
  int64_t n = 0;
  at::Tensor table = chunk_table(slots, bucket.element_size(), bucket.device(), &n);
  if (n == 0) return;
  const gpu::Stream stream = gpu::current_stream(bucket.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bucket.scalar_type(), "bucket_pack_", [&] {
    gpu::launch("pack_kernel", &pack_kernel<scalar_t>, dim3(static_cast<unsigned>(n)),
                dim3(kThreads), stream, bucket.data_ptr<scalar_t>(),
                reinterpret_cast<const DevChunk*>(table.data_ptr()), static_cast<float>(scale));
  });
}

std::tuple<at::Tensor, at::Tensor> bucket_unpack_cuda(const at::Tensor& bucket,
                                                      at::TensorList grads,
                                                      at::IntArrayRef offsets,
                                                      const at::Tensor& inv_scale) {
  gpu::check_device(bucket.device(), "fastamp::bucket_unpack_", "bucket");
  const auto slots = check_bucket_unpack(bucket, grads, offsets, inv_scale);
  gpu::DeviceGuard guard(bucket.device());
  const auto opts = bucket.options().dtype(at::kFloat);
  at::Tensor found = at::zeros({}, opts);
  at::Tensor pow_sum = at::zeros({}, opts);
  int64_t n = 0;
  at::Tensor table = chunk_table(slots, bucket.element_size(), bucket.device(), &n);
  if (n == 0) return {found, pow_sum};
  at::Tensor partials = at::empty({n}, opts);
  const gpu::Stream stream = gpu::current_stream(bucket.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bucket.scalar_type(), "bucket_unpack_", [&] {
    gpu::launch("unpack_kernel", &unpack_kernel<scalar_t>, dim3(static_cast<unsigned>(n)),
                dim3(kThreads), stream, static_cast<const scalar_t*>(bucket.data_ptr<scalar_t>()),
                reinterpret_cast<const DevChunk*>(table.data_ptr()),
                static_cast<const float*>(inv_scale.data_ptr<float>()), partials.data_ptr<float>(),
                found.data_ptr<float>());
  });
  gpu::launch("sum_partials", &sum_partials, dim3(1), dim3(kThreads), stream,
              static_cast<const float*>(partials.data_ptr<float>()), n, pow_sum.data_ptr<float>());
  return {found, pow_sum};
}

}  // namespace
}  // namespace distributed
}  // namespace fastamp

FASTAMP_CUDA_KERNELS(m) {
  m.impl("bucket_pack_", &fastamp::distributed::bucket_pack_cuda);
  m.impl("bucket_unpack_", &fastamp::distributed::bucket_unpack_cuda);
}
