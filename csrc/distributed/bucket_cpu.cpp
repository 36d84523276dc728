// CPU kernels of the gradient-bucket ops.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "common/multi_tensor_apply.h"
#include "distributed/bucket_checks.h"
#include "scaler/scaler_math.h"

#include <vector>

namespace fastamp {
namespace distributed {
namespace {

// Chunks of the slots, so large grads spread over threads and the sums stay deterministic.
std::vector<Chunk> slot_chunks(const std::vector<Slot>& slots) {
  std::vector<FlatTensor> flat;
  flat.reserve(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    flat.push_back(FlatTensor{slots[i].grad, slots[i].numel, at::kFloat, static_cast<int64_t>(i)});
  }
  return plan_chunks(flat);
}

void bucket_pack_cpu(at::Tensor& bucket, at::TensorList grads, at::IntArrayRef offsets,
                     double scale) {
  const auto slots = check_bucket("fastamp::bucket_pack_", bucket, grads, offsets);
  const auto chunks = slot_chunks(slots);
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bucket.scalar_type(), "bucket_pack_", [&] {
    scalar_t* b = bucket.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const Chunk& ch = chunks[static_cast<size_t>(c)];
        const Slot& sl = slots[static_cast<size_t>(ch.item)];
        const scalar_t* g = static_cast<const scalar_t*>(sl.grad) + ch.start;
        scalar_t* dst = b + sl.offset + ch.start;
        for (int64_t i = 0; i < ch.len; ++i) {
          dst[i] = static_cast<scalar_t>(static_cast<float>(g[i]) * s);
        }
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> bucket_unpack_cpu(const at::Tensor& bucket, at::TensorList grads,
                                                     at::IntArrayRef offsets,
                                                     const at::Tensor& inv_scale) {
  const auto slots = check_bucket_unpack(bucket, grads, offsets, inv_scale);
  const auto chunks = slot_chunks(slots);
  std::vector<float> partial(chunks.size(), 0.0f);
  std::vector<uint8_t> bad(chunks.size(), 0);
  const float inv = *inv_scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bucket.scalar_type(), "bucket_unpack_", [&] {
    const scalar_t* b = bucket.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const Chunk& ch = chunks[static_cast<size_t>(c)];
        const Slot& sl = slots[static_cast<size_t>(ch.item)];
        const scalar_t* src = b + sl.offset + ch.start;
        scalar_t* g = static_cast<scalar_t*>(sl.grad) + ch.start;
        // Independent lanes, as in the scaler's stats pass: accurate fp32 sums over 64 Ki terms.
        // A fixed inner loop over the lanes (not acc[i % kLanes]) so that it vectorises.
        constexpr int kLanes = 16;
        float acc[kLanes] = {};
        float probe[kLanes] = {};
        int64_t i = 0;
        for (; i + kLanes <= ch.len; i += kLanes) {
          for (int j = 0; j < kLanes; ++j) {
            const scalar_t x = src[i + j];
            g[i + j] = x;
            const float v = static_cast<float>(x);
            probe[j] += scaler::nonfinite_probe(v);
            const float u = scaler::unscale(v, inv);
            acc[j] += u * u;
          }
        }
        for (int j = 0; i < ch.len; ++i, ++j) {
          const scalar_t x = src[i];
          g[i] = x;
          const float v = static_cast<float>(x);
          probe[j] += scaler::nonfinite_probe(v);
          const float u = scaler::unscale(v, inv);
          acc[j] += u * u;
        }
        float sum = 0.0f;
        float probe_sum = 0.0f;
        for (int j = 0; j < kLanes; ++j) {
          sum += acc[j];
          probe_sum += probe[j];
        }
        partial[static_cast<size_t>(c)] = sum;
        bad[static_cast<size_t>(c)] = probe_sum != 0.0f;
      }
    });
  });
  float total = 0.0f;
  bool any = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    total += partial[c];
    any = any || bad[c];
  }
  const auto opts = bucket.options().dtype(at::kFloat);
  return {at::full({}, any ? 1.0f : 0.0f, opts), at::full({}, total, opts)};
}

}  // namespace
}  // namespace distributed
}  // namespace fastamp

TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  m.impl("bucket_pack_", &fastamp::distributed::bucket_pack_cpu);
  m.impl("bucket_unpack_", &fastamp::distributed::bucket_unpack_cpu);
}
