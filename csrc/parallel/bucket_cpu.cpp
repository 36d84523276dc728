// CPU kernels of the gradient-bucket ops.
#include "common/torch_api.h"

#include "common/multi_tensor_apply_cpu.h"
#include "parallel/bucket_checks.h"
#include "scaler/scaler_cpu_kernels.h"
#include "scaler/scaler_math.h"

#include <algorithm>
#include <vector>

namespace fastamp {
namespace parallel {
namespace {

// Calls f(static_cast<T*>(nullptr)) for the element type T of a bucket's dtype (checked before).
template <typename F>
void dispatch_bucket_dtype(ScalarType dtype, const F& f) {
  switch (dtype) {
    case ScalarType::Float:
      f(static_cast<float*>(nullptr));
      break;
    case ScalarType::Half:
      f(static_cast<c10::Half*>(nullptr));
      break;
    case ScalarType::BFloat16:
      f(static_cast<c10::BFloat16*>(nullptr));
      break;
    default:
      FASTAMP_ASSERT(false, "unexpected bucket dtype ", dtype);
  }
}

// Chunks of the slots, so large grads spread over threads and the sums stay deterministic.
std::vector<Chunk> slot_chunks(const std::vector<Slot>& slots) {
  std::vector<FlatTensor> flat;
  flat.reserve(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    flat.push_back(FlatTensor{slots[i].grad, slots[i].numel, kFloat, static_cast<int64_t>(i)});
  }
  return plan_chunks(flat);
}

// The per-chunk L2 partials and inf/NaN flags of a statistics pass, combined in chunk order as
// grad_stats combines its own: (found_inf, norm_pow_sum) as float32 [] tensors on `dev`.
struct ChunkStats {
  std::vector<float> partial;
  std::vector<uint8_t> bad;

  explicit ChunkStats(size_t chunks) : partial(chunks, 0.0f), bad(chunks, 0) {}

  std::tuple<Tensor, Tensor> result(const Device& dev) const {
    float total = 0.0f;
    bool any = false;
    for (size_t c = 0; c < partial.size(); ++c) {
      total = scaler::norm_combine<scaler::NormKind::kL2>(total, partial[c]);
      any = any || bad[c];
    }
    return {full({}, any ? 1.0 : 0.0, kFloat, dev), full({}, total, kFloat, dev)};
  }
};

void bucket_pack_cpu(Tensor& bucket, TensorList grads, IntList offsets, double scale) {
  const auto slots = check_bucket("fastamp::bucket_pack_", bucket, grads, offsets);
  const auto chunks = slot_chunks(slots);
  const float s = static_cast<float>(scale);
  dispatch_bucket_dtype(bucket.scalar_type(), [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    scalar_t* b = bucket.mutable_data_ptr<scalar_t>();
    cpu_for_each_chunk(chunks, [&](int64_t, const Chunk& ch) {
      const Slot& sl = slots[static_cast<size_t>(ch.item)];
      const scalar_t* g = static_cast<const scalar_t*>(sl.grad) + ch.start;
      scalar_t* dst = b + sl.offset + ch.start;
      for (int64_t i = 0; i < ch.len; ++i) {
        dst[i] = static_cast<scalar_t>(static_cast<float>(g[i]) * s);
      }
    });
  });
}

// The copy and the scaler's own stats kernel in one pass over each chunk (copy_stats: the stats
// loop stores what it loads): the norm and inf flag DDP hands the scaler are grad_stats' on the
// unpacked grads, bit for bit (same chunks, same per-chunk kernel, partials combined in chunk
// order).
std::tuple<Tensor, Tensor> bucket_unpack_cpu(const Tensor& bucket, TensorList grads,
                                             IntList offsets, const Tensor& inv_scale) {
  const auto slots = check_bucket_unpack(bucket, grads, offsets, inv_scale);
  const auto chunks = slot_chunks(slots);
  ChunkStats st(chunks.size());
  const float inv = *inv_scale.mutable_data_ptr<float>();
  const auto dtype = bucket.scalar_type();
  const scaler::CpuKernels& k = scaler::cpu_kernels();
  constexpr auto kL2 = static_cast<int32_t>(scaler::NormKind::kL2);
  dispatch_bucket_dtype(dtype, [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const scalar_t* b = bucket.mutable_data_ptr<scalar_t>();
    cpu_for_each_chunk(chunks, [&](int64_t c, const Chunk& ch) {
      const Slot& sl = slots[static_cast<size_t>(ch.item)];
      scalar_t* g = static_cast<scalar_t*>(sl.grad) + ch.start;
      bool nonfinite = false;
      k.copy_stats(dtype, kL2, b + sl.offset + ch.start, g, ch.len, inv, 2.0f,
                   &st.partial[static_cast<size_t>(c)], &nonfinite);
      st.bad[static_cast<size_t>(c)] = nonfinite ? 1 : 0;
    });
  });
  return st.result(bucket.device());
}

// The division and the scaler's own stats kernel per chunk of 65536 elements: the chunk is divided
// in place, then measured while it is still in cache (one trip to memory), with grad_stats' chunks
// and per-chunk kernel over the divided values: the statistics are grad_stats' over the spans after
// the division, bit for bit.
std::tuple<Tensor, Tensor> bucket_divide_stats_cpu(Tensor& bucket, IntList lengths, double divisor,
                                                   const Tensor& inv_scale) {
  const auto spans = check_bucket_spans(bucket, lengths, divisor, inv_scale);
  const auto chunks = slot_chunks(spans);
  ChunkStats st(chunks.size());
  const float inv = *inv_scale.mutable_data_ptr<float>();
  const float s = static_cast<float>(1.0 / divisor);  // x * (1 / divisor), as torch's mul_
  const bool divide = divisor != 1.0;
  const auto dtype = bucket.scalar_type();
  const scaler::CpuKernels& k = scaler::cpu_kernels();
  constexpr auto kL2 = static_cast<int32_t>(scaler::NormKind::kL2);
  dispatch_bucket_dtype(dtype, [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    cpu_for_each_chunk(chunks, [&](int64_t c, const Chunk& ch) {
      scalar_t* x = static_cast<scalar_t*>(spans[static_cast<size_t>(ch.item)].grad) + ch.start;
      if (divide) {
        for (int64_t i = 0; i < ch.len; ++i) {
          x[i] = static_cast<scalar_t>(static_cast<float>(x[i]) * s);
        }
      }
      bool nonfinite = false;
      k.stats(dtype, kL2, x, ch.len, inv, 2.0f, &st.partial[static_cast<size_t>(c)], &nonfinite);
      st.bad[static_cast<size_t>(c)] = nonfinite ? 1 : 0;
    });
  });
  return st.result(bucket.device());
}

}  // namespace
}  // namespace parallel
}  // namespace fastamp

STABLE_TORCH_LIBRARY_IMPL(fastamp, CPU, m) {
  m.impl("bucket_pack_", TORCH_BOX(&fastamp::parallel::bucket_pack_cpu));
  m.impl("bucket_unpack_", TORCH_BOX(&fastamp::parallel::bucket_unpack_cpu));
  m.impl("bucket_divide_stats_", TORCH_BOX(&fastamp::parallel::bucket_divide_stats_cpu));
}
