/// @file scaler_cuda.cuh
/// The device side of the gradient statistics (inf check + norm partials), shared by the scaler's
/// grad_stats and the gradient buckets' unpack, so that both compute a chunk's partial the same
/// way: same per-thread element order (the engine's chunk loop), same accumulation (StatsAcc),
/// same block reduction, same per-chunk slot, and the same fixed-order combine. Over the same
/// grads they return the same bits.
#pragma once

#include "common/gpu.cuh"
#include "common/multi_tensor_apply_cuda.cuh"
#include "scaler/scaler_math.h"

#include <type_traits>

namespace fastamp {
namespace scaler {

/// Inf-norm partials combine by max, every other norm by sum (the partials are already |x|^p).
template <NormKind K>
constexpr NormKind kCombineKind = K == NormKind::kInf ? NormKind::kInf : NormKind::kL2;

template <NormKind K>
struct CombineFn {
  __host__ __device__ __forceinline__ float operator()(float a, float b) const {
    return norm_combine<kCombineKind<K>>(a, b);
  }
};

/// One thread's running statistics over the elements it visits: the non-finite probe (on the
/// values before unscaling, as PyTorch's check) and the norm accumulator of the unscaled values.
template <NormKind K, typename T>
struct StatsAcc {
  using acc_t = opmath_t<T>;
  float inv;
  float p;
  float acc = 0.0f;
  acc_t probe = acc_t(0);

  __device__ __forceinline__ StatsAcc(float inv_scale, float norm_p) : inv(inv_scale), p(norm_p) {}

  __device__ __forceinline__ void add(T x) {
    const acc_t v = static_cast<acc_t>(x);
    probe += nonfinite_probe(v);
    const float u = static_cast<float>(unscale(v, inv));
    acc = norm_combine<K>(acc, norm_term<K>(u, p));
  }

  __device__ __forceinline__ bool nonfinite() const { return probe != acc_t(0); }
};

constexpr int kFinalizeThreads = 512;

/// Combines the per-chunk partials in a fixed order (a fixed thread-to-partial assignment, then a
/// fixed tree), so the norm is bitwise reproducible for given sizes.
template <NormKind K>
__global__ void __launch_bounds__(kFinalizeThreads)
    combine_partials_kernel(const float* partials, int64_t n, float* out) {
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += kFinalizeThreads) {
    acc = norm_combine<K>(acc, partials[i]);
  }
  acc = mta_block_reduce<kFinalizeThreads>(
      acc, [](float a, float b) { return norm_combine<K>(a, b); }, 0.0f);
  if (threadIdx.x == 0) *out = acc;
}

/// Launches combine_partials_kernel for partials of norm kind K (stream-ordered).
template <NormKind K>
void launch_combine(const float* partials, int64_t n, float* out, const Device& device) {
  constexpr NormKind C = kCombineKind<K>;
  gpu::launch("combine_partials_kernel", &combine_partials_kernel<C>, dim3(1),
              dim3(kFinalizeThreads), gpu::current_stream(device), partials, n, out);
}

/// Chunks the engine will cut `items` into (one partial slot each).
inline int64_t count_chunks(const std::vector<FlatTensor>& items) {
  int64_t n = 0;
  for (const auto& t : items) n += (t.numel + kChunkElems - 1) / kChunkElems;
  return n;
}

}  // namespace scaler
}  // namespace fastamp
